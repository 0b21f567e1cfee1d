"""The peers that the cases compare horovod_ray against and that live apart from them:
raw Gloo's C++ ring allreduce (``gloo_allreduce.cc``, built by CMake) and its launcher
(``raw_gloo``), and Ray Train v2 answering B10's drain (``train_drain``, in a process of
its own). The peers that share a case's module (horovodrun, horovod.ray, Ray Train's
trainers, torch.distributed) stay in that case."""
