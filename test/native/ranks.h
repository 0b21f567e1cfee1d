// Gloo ranks as threads of one test process, each with a TCP device of its own on
// loopback, for the native tests in this folder.

#pragma once

#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

// Rank ``rank`` of ``size`` connected to every other through ``store``.
inline std::shared_ptr<gloo::rendezvous::Context> Connect(
    int rank, int size, gloo::rendezvous::Store& store, std::chrono::seconds timeout) {
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  context->setTimeout(timeout);
  context->connectFullMesh(store, device);
  return context;
}

// Runs body(rank) for every rank at once, a thread each, and waits for them all. Returns
// "" or the lowest failing rank's error as "rank N: what".
template <typename Body>
std::string OnEveryRank(int size, Body body) {
  std::vector<std::exception_ptr> failed(size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; rank++) {
    threads.emplace_back([&, rank] {
      try {
        body(rank);
      } catch (...) {
        failed[rank] = std::current_exception();
      }
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }
  for (int rank = 0; rank < size; rank++) {
    if (failed[rank]) {
      try {
        std::rethrow_exception(failed[rank]);
      } catch (const std::exception& e) {
        return "rank " + std::to_string(rank) + ": " + e.what();
      }
    }
  }
  return "";
}
