// Gloo's ReduceScatterHalvingDoubling on 3 ranks (threads of one process): on a rank
// count that is not a power of two, rank 2 sends its halves to ranks 0 and 1, and nothing
// it waits for depends on rank 0 having received its half. Built by
// test/test_collectives.py against the Gloo library that horovod's build compiled from
// build/horovod-*/third_party/gloo, patches applied.
//
// writev() is interposed: rank 2's connection to rank 0 takes 8 KB at a time, each after
// 5 ms, so that send is still queued when rank 2 has everything it waits for. Rank 2 then
// does what horovod does with a finished reducescatter's buffer: it frees or reuses it
// (here, fills it with -1). With patches/horovod-0.28.1-gloo-reduce-scatter-waits-for-
// its-sends.patch, run() returns only once its sends are written, so rank 0's result is
// right: this prints "right" and exits 0. Without it, rank 0 reduces the -1s that rank 2
// wrote after run() returned: "wrong at element N" and exit 1.

#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <gloo/reduce_scatter.h>
#include <gloo/rendezvous/hash_store.h>

#include "ranks.h"

namespace {

constexpr int kSize = 3;
constexpr int kPerRank = 100000;  // floats each rank ends with; 600 KB from rank 2 to 0
constexpr size_t kSlowChunk = 8192;

// The slot of rank 2's data for rank 0 (set before the ranks run), and the sockets seen
// carrying it, which are slowed from then on.
std::atomic<long> slow_slot{-1};
std::mutex slow_mutex;
std::set<int> slow_fds;
thread_local bool wrote_last_call = false;

bool IsSlow(int fd, const struct iovec* iov, int iovcnt) {
  std::lock_guard<std::mutex> lock(slow_mutex);
  if (slow_fds.count(fd) != 0) {
    return true;
  }
  // A new op's first write starts with its preamble: six size_t, the third its slot.
  constexpr size_t kPreamble = 6 * sizeof(size_t);
  if (iovcnt > 0 && iov[0].iov_len == kPreamble) {
    const auto* preamble = static_cast<const size_t*>(iov[0].iov_base);
    if (preamble[1] == 0 /* SEND_BUFFER */ && long(preamble[2]) == slow_slot.load()) {
      slow_fds.insert(fd);
      return true;
    }
  }
  return false;
}

// The slot offset the algorithm took, to find rank 2's send to rank 0 by its slot.
class ReduceScatter : public gloo::ReduceScatterHalvingDoubling<float> {
 public:
  using gloo::ReduceScatterHalvingDoubling<float>::ReduceScatterHalvingDoubling;
  int SlotOffset() const { return slotOffset_; }
};

}  // namespace

// Gloo's TCP pairs write with writev(); this one is linked in its place.
extern "C" ssize_t writev(int fd, const struct iovec* iov, int iovcnt) {
  if (!IsSlow(fd, iov, iovcnt)) {
    return syscall(SYS_writev, fd, iov, iovcnt);
  }
  // Right after a short write Gloo tries again at once: say the socket is full, so that
  // the rest goes to its device thread, which comes back when the socket is writable.
  if (wrote_last_call) {
    wrote_last_call = false;
    errno = EAGAIN;
    return -1;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  std::vector<struct iovec> part;
  size_t room = kSlowChunk;
  for (int i = 0; i < iovcnt && room > 0; i++) {
    size_t take = std::min(room, iov[i].iov_len);
    part.push_back({iov[i].iov_base, take});
    room -= take;
  }
  wrote_last_call = true;
  return syscall(SYS_writev, fd, part.data(), int(part.size()));
}

int main() {
  gloo::rendezvous::HashStore store;
  std::shared_ptr<gloo::rendezvous::Context> contexts[kSize];
  std::string failure = OnEveryRank(kSize, [&](int rank) {
    contexts[rank] = Connect(rank, kSize, store, std::chrono::seconds(30));
  });
  if (!failure.empty()) {
    std::printf("setup failed: %s\n", failure.c_str());
    return 2;
  }

  const int count = kSize * kPerRank;
  const std::vector<int> recv_counts(kSize, kPerRank);
  std::vector<std::vector<float>> data(kSize, std::vector<float>(count));
  std::vector<std::unique_ptr<ReduceScatter>> algorithms;
  for (int rank = 0; rank < kSize; rank++) {
    for (int i = 0; i < count; i++) {
      data[rank][i] = float(rank + 1 + i % 7);
    }
    std::vector<float*> ptrs{data[rank].data()};
    algorithms.emplace_back(
        new ReduceScatter(contexts[rank], ptrs, count, recv_counts));
  }
  // Gloo's pair slot for ranks 0 and 2 (see ReduceScatterHalvingDoubling's constructor).
  slow_slot = algorithms[2]->SlotOffset() + 2 * (0 * kSize + 2);

  failure = OnEveryRank(kSize, [&](int rank) {
    algorithms[rank]->run();
    if (rank == 2) {
      // What horovod does next with the buffer: frees it or fills it again.
      std::fill(data[rank].begin(), data[rank].end(), -1.0f);
    }
  });
  if (!failure.empty()) {
    std::printf("%s\n", failure.c_str());
    return 2;
  }
  if (slow_fds.empty()) {
    std::printf("rank 2's send to rank 0 was never seen: nothing was tested\n");
    return 2;
  }
  // Rank 0 ends with the sums of the first kPerRank elements: 1 + 2 + 3 + 3 (i % 7).
  for (int i = 0; i < kPerRank; i++) {
    const float want = float(6 + 3 * (i % 7));
    if (data[0][i] != want) {
      std::printf("wrong at element %d: %g, not %g\n", i, data[0][i], want);
      return 1;
    }
  }
  std::printf("right\n");
  return 0;
}
