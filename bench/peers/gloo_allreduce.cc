// Raw Gloo ring allreduce over TCP on loopback: the ceiling for the B1 benchmark.
//
// One process per rank, all started by bench/run.py; they meet through a file store.
// --host picks the address Gloo binds (default loopback; B6 gives each simulated host's).
// Same work as the Horovod systems: a float32 buffer of --bytes, summed --iters times after
// --warmup untimed rounds. Rank 0 prints one JSON line with the timed seconds.
//
//   gloo_allreduce --rank 0 --size 2 --store /tmp/dir --bytes 67108864 --iters 60 [--host IP]

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gloo/allreduce_ring.h>
#include <gloo/barrier_all_to_all.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

namespace {

struct Options {
  int rank = -1;
  int size = -1;
  std::string store;
  std::string prefix = "bench";
  std::string host = "127.0.0.1";
  long bytes = 64L << 20;
  int iters = 60;
  int warmup = 3;
};

[[noreturn]] void Usage(const char* program) {
  std::fprintf(stderr,
               "usage: %s --rank R --size N --store DIR [--prefix P] [--bytes B] "
               "[--iters I] [--warmup W] [--host IP]\n",
               program);
  std::exit(2);
}

Options Parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* value = argv[i + 1];
    if (flag == "--rank") options.rank = std::atoi(value);
    else if (flag == "--size") options.size = std::atoi(value);
    else if (flag == "--store") options.store = value;
    else if (flag == "--prefix") options.prefix = value;
    else if (flag == "--bytes") options.bytes = std::atol(value);
    else if (flag == "--iters") options.iters = std::atoi(value);
    else if (flag == "--warmup") options.warmup = std::atoi(value);
    else if (flag == "--host") options.host = value;
    else Usage(argv[0]);
  }
  if (options.rank < 0 || options.size < 1 || options.rank >= options.size ||
      options.store.empty() || options.bytes < 4 || options.iters < 1) {
    Usage(argv[0]);
  }
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  const Options options = Parse(argc, argv);

  gloo::transport::tcp::attr attr;
  attr.hostname = options.host;
  auto device = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore file_store(options.store);
  gloo::rendezvous::PrefixStore store(options.prefix, file_store);
  auto context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.size);
  context->connectFullMesh(store, device);

  const int count = static_cast<int>(options.bytes / sizeof(float));
  std::vector<float> data(count, 1.0f);
  gloo::AllreduceRing<float> allreduce(context, {data.data()}, count);
  gloo::BarrierAllToAll barrier(context);

  for (int i = 0; i < options.warmup; ++i) allreduce.run();
  barrier.run();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < options.iters; ++i) allreduce.run();
  const auto end = std::chrono::steady_clock::now();
  const double seconds = std::chrono::duration<double>(end - start).count();

  if (options.rank == 0) {
    std::printf("{\"seconds\": %.6f, \"bytes\": %ld, \"iters\": %d, \"size\": %d}\n", seconds,
                options.bytes, options.iters, options.size);
  }
  return 0;
}
