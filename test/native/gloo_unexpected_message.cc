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
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/transport/tcp/device.h>

namespace {

constexpr int kSize = 2;
constexpr uint64_t kSlot = 7;

std::shared_ptr<gloo::rendezvous::Context> Connect(int rank, gloo::rendezvous::Store& store) {
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, kSize);
  context->setTimeout(std::chrono::seconds(20));
  context->connectFullMesh(store, device);
  return context;
}

}  // namespace

int main() {
  gloo::rendezvous::HashStore store;
  std::shared_ptr<gloo::rendezvous::Context> contexts[kSize];
  // Any failure to get as far as the out-of-step message exits 2, not as the abort
  // that the test looks for.
  try {
    std::exception_ptr failed;
    std::thread other([&] {
      try {
        contexts[1] = Connect(1, store);
      } catch (...) {
        failed = std::current_exception();
      }
    });
    contexts[0] = Connect(0, store);
    other.join();
    if (failed) {
      std::rethrow_exception(failed);
    }
  } catch (const std::exception& e) {
    std::printf("setup failed: %s\n", e.what());
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
