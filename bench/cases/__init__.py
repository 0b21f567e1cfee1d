"""The benchmark cases, one module per figure or group of figures: B1 to B13, BT and the
rendezvous at scale, each comparing horovod_ray with the peers a user would pick instead;
``workloads`` holds the work their ranks do, the same under every system, and
``b8_script`` the whole script that B8 runs from a fresh process."""
