// Two Gloo ranks in one process, one thread each, out of step on one slot: rank 1 sends
// 8 bytes where rank 0 has posted a receive of 4 (as an elastic survivor was seen to
// receive right after a peer's node went). Built by test/test_environment.py against the Gloo library that horovod's
// build compiled from build/horovod-*/third_party/gloo, patches applied.
//
// With patches/horovod-0.28.1-gloo-unexpected-message.patch, rank 0's receive raises an
// IoException: this prints "raised: <message>" and exits 0. Without it, Gloo's device
// thread throws and the whole process aborts.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <thread>

#include <gloo/common/error.h>
#include <gloo/rendezvous/hash_store.h>

#include "ranks.h"

namespace {

constexpr int kSize = 2;
constexpr uint64_t kSlot = 7;

}  // namespace

int main() {
  gloo::rendezvous::HashStore store;
  std::shared_ptr<gloo::rendezvous::Context> contexts[kSize];
  // Any failure to get as far as the out-of-step message exits 2, not as the abort
  // that the test looks for.
  const std::string failure = OnEveryRank(kSize, [&](int rank) {
    contexts[rank] = Connect(rank, kSize, store, std::chrono::seconds(20));
  });
  if (!failure.empty()) {
    std::printf("setup failed: %s\n", failure.c_str());
    return 2;
  }

  std::thread sender([&] {
    int64_t eight = 8;
    try {
      auto buffer = contexts[1]->createUnboundBuffer(&eight, sizeof(eight));
      buffer->send(0, kSlot);
      buffer->waitSend();
    } catch (const gloo::IoException&) {
      // The receiving side may close the connection before this send is acknowledged.
    }
  });

  int32_t four = 0;
  auto buffer = contexts[0]->createUnboundBuffer(&four, sizeof(four));
  buffer->recv(1, kSlot);
  int status = 1;
  try {
    buffer->waitRecv();
    std::printf("received %d without an error\n", four);
  } catch (const gloo::IoException& e) {
    std::printf("raised: %s\n", e.what());
    status = 0;
  }
  sender.join();
  return status;
}
