// The rendezvous traffic of N Horovod ranks, from the client code horovod runs.
//
// Each simulated rank is a thread that does, against a live rendezvous server, what
// hvd.init() does in one Gloo scope: horovod's HTTPStore (horovod/common/gloo) carries
// Gloo's exchangeAddresses (gloo/rendezvous/context.cc, the store half of
// connectFullMesh), then Finalize() as horovod does after its barrier. Both come from
// horovod's build tree with this repository's patches, so the requests are the ones a
// real rank sends. Only the Gloo pairs are not opened: each rank publishes a made-up
// 136-byte address per peer (the size of Gloo's TCP address) and checks that what it
// reads back is what its peer wrote for it.
//
//   rendezvous_load --addr HOST:PORT/SECRET --port PORT --size N [--scope global]
//                   [--batched 0|1] [--timeout-s T] [--deadline-s D]
//
// Prints one JSON line: {"size", "batched", "seconds", "done", "failed", "wrong",
// "local_rank_off", "finished"}. "finished" is false when the deadline passed before
// every rank was done; "seconds" is then the deadline.

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "gloo/rendezvous/context.h"
#include "horovod/common/gloo/http_store.h"

namespace {

constexpr size_t kAddressBytes = 136;

struct Options {
  std::string addr;
  int port = -1;
  int size = -1;
  std::string scope = "global";
  bool batched = true;
  double timeout_s = 120;
  double deadline_s = 120;
};

struct Shared {
  Options options;
  std::mutex mutex;
  // Each waits for its own event and is told once, when it happens: with one
  // notify_all per rank, N waiting threads woke N times (N^2 wake-ups), which at 4096
  // ranks took more CPU than the rendezvous itself.
  std::condition_variable all_ready;  // main thread
  std::condition_variable go_now;     // ranks, before starting
  std::condition_variable all_exchanged;  // ranks, at the barrier
  std::condition_variable all_finished;   // main thread
  int ready = 0;
  bool go = false;
  int exchanged = 0;
  int finished = 0;
  std::atomic<int> failed{0};
  std::atomic<int> wrong{0};
  std::atomic<int> local_rank_off{0};
};

struct Rank {
  Shared* shared;
  int rank;
};

// What rank `from` publishes for its pair with rank `to`: unique per ordered pair.
std::vector<char> AddressFor(int from, int to) {
  std::vector<char> bytes(kAddressBytes, 0);
  std::snprintf(bytes.data(), bytes.size(), "%d->%d", from, to);
  return bytes;
}

void* RunRank(void* arg) {
  auto* me = static_cast<Rank*>(arg);
  Shared& shared = *me->shared;
  const Options& options = shared.options;
  {
    std::unique_lock<std::mutex> lock(shared.mutex);
    if (++shared.ready == options.size) {
      shared.all_ready.notify_one();
    }
    shared.go_now.wait(lock, [&] { return shared.go; });
  }
  bool exchanged = false;
  try {
    const auto timeout = std::chrono::milliseconds(
        static_cast<long>(options.timeout_s * 1000));
    horovod::common::HTTPStore store(options.addr, options.port, options.scope, me->rank,
                                     timeout, options.batched);
    std::vector<std::vector<char>> mine(options.size);
    for (int peer = 0; peer < options.size; ++peer) {
      if (peer != me->rank) {
        mine[peer] = AddressFor(me->rank, peer);
      }
    }
    int local_rank = 0;
    // One made-up host: every earlier rank counts towards the local rank.
    gloo::rendezvous::exchangeAddresses(
        store, me->rank, options.size, "simulated-host", mine, timeout, local_rank,
        [&](int peer, const std::vector<char>& address) {
          if (address != AddressFor(peer, me->rank)) {
            shared.wrong++;
          }
        });
    // Gloo's per-key sequence reads earlier ranks' host names without waiting for
    // them, so under load it can count too few; counted apart from wrong addresses.
    if (local_rank != me->rank) {
      shared.local_rank_off++;
    }
    {
      // horovod's Rendezvous() runs a Gloo barrier here, so that no rank's Finalize()
      // clears the scope while a peer still reads it; these threads barrier in-process.
      std::unique_lock<std::mutex> lock(shared.mutex);
      exchanged = true;
      if (++shared.exchanged == options.size) {
        shared.all_exchanged.notify_all();
      }
      shared.all_exchanged.wait(lock, [&] { return shared.exchanged == options.size; });
    }
    store.Finalize();
  } catch (const std::exception& err) {
    if (shared.failed++ == 0) {
      std::fprintf(stderr, "rank %d: %s\n", me->rank, err.what());
    }
    std::lock_guard<std::mutex> lock(shared.mutex);
    if (!exchanged) {
      // Its peers are not kept waiting at the barrier by a rank that gave up.
      if (++shared.exchanged == options.size) {
        shared.all_exchanged.notify_all();
      }
    }
  }
  std::lock_guard<std::mutex> lock(shared.mutex);
  shared.finished++;
  if (shared.finished == options.size) {
    shared.all_finished.notify_one();
  }
  return nullptr;
}

[[noreturn]] void Usage(const char* program) {
  std::fprintf(stderr,
               "usage: %s --addr HOST:PORT/SECRET --port PORT --size N [--scope S] "
               "[--batched 0|1] [--timeout-s T] [--deadline-s D]\n",
               program);
  std::exit(2);
}

Options Parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* value = argv[i + 1];
    if (flag == "--addr") {
      options.addr = value;
    } else if (flag == "--port") {
      options.port = std::atoi(value);
    } else if (flag == "--size") {
      options.size = std::atoi(value);
    } else if (flag == "--scope") {
      options.scope = value;
    } else if (flag == "--batched") {
      options.batched = std::atoi(value) != 0;
    } else if (flag == "--timeout-s") {
      options.timeout_s = std::atof(value);
    } else if (flag == "--deadline-s") {
      options.deadline_s = std::atof(value);
    } else {
      Usage(argv[0]);
    }
  }
  if (argc % 2 == 0 || options.addr.empty() || options.port <= 0 || options.size < 2) {
    Usage(argv[0]);
  }
  return options;
}

} // namespace

int main(int argc, char** argv) {
  auto* shared = new Shared();  // left to the threads still running at the deadline
  shared->options = Parse(argc, argv);
  const int size = shared->options.size;
  std::vector<Rank> ranks(size);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 256 << 10);
  for (int rank = 0; rank < size; ++rank) {
    ranks[rank] = Rank{shared, rank};
    pthread_t thread;
    if (pthread_create(&thread, &attr, RunRank, &ranks[rank]) != 0) {
      std::fprintf(stderr, "could not start thread %d\n", rank);
      return 2;
    }
    pthread_detach(thread);
  }
  std::unique_lock<std::mutex> lock(shared->mutex);
  shared->all_ready.wait(lock, [&] { return shared->ready == size; });
  // All ranks start together, as hvd.init() on a job whose workers are all up.
  const auto start = std::chrono::steady_clock::now();
  shared->go = true;
  shared->go_now.notify_all();
  const auto deadline = start + std::chrono::milliseconds(
                                    static_cast<long>(shared->options.deadline_s * 1000));
  const bool finished = shared->all_finished.wait_until(
      lock, deadline, [&] { return shared->finished == size; });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "{\"size\": %d, \"batched\": %s, \"seconds\": %.3f, \"done\": %d, \"failed\": %d, "
      "\"wrong\": %d, \"local_rank_off\": %d, \"finished\": %s}\n",
      size, shared->options.batched ? "true" : "false", seconds,
      shared->finished - shared->failed.load(), shared->failed.load(), shared->wrong.load(),
      shared->local_rank_off.load(), finished ? "true" : "false");
  std::fflush(stdout);
  // Threads still in a request at the deadline are not waited for.
  _exit(0);
}
