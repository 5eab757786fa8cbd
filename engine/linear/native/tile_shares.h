// How a product's tiles are split over torch's threads: each thread walks an even, contiguous share front to back (one
// stream of codes, which its prefetches run ahead of), and a thread whose share is done takes the back half of what is
// left of the fullest other share, and walks that. A tile's result never depends on which thread computed it.
//
// Why not torch's even split alone: a decode step's products are memory-bound, and two threads on two cores of a
// shared host seldom finish an even split together; the first one done waited at the region's end while the other
// read on alone, at a fraction of the machine's rate (perf, 1B Q4_K_M, one stream: the main thread spent 12% of its
// time in libgomp's wait, 3.5% with the shares; the products alike with the cores to themselves, 1.03-1.04x with
// other work beside them, as a server's event loop and clients are: bench/README.md, session 48). Chunks handed out
// from one counter gained nothing (0.99x): each chunk starts a stream cold, with nothing fetched ahead of it, where a
// share or a stolen half is one long stream.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace kvserve {

class TileShares {
 public:
  TileShares(int64_t tiles, int64_t shares) : spans_(shares) {
    for (int64_t i = 0; i < shares; ++i) spans_[i].set(tiles * i / shares, tiles * (i + 1) / shares);
  }

  int64_t shares() const { return static_cast<int64_t>(spans_.size()); }

  // The next tile of share i, front first; false once none is left.
  bool next(int64_t i, int64_t& tile) {
    std::atomic<uint64_t>& span = spans_[i].bits;
    uint64_t v = span.load(std::memory_order_relaxed);
    do {
      if (front(v) >= back(v)) return false;
    } while (!span.compare_exchange_weak(v, v + 1, std::memory_order_relaxed));
    tile = front(v);
    return true;
  }

  // Share `thief` (done) takes the back half of the fullest other share that has two tiles or more left; false
  // when none has.
  bool steal(int64_t thief) {
    while (true) {
      int64_t victim = -1;
      uint64_t most = 1;
      for (int64_t i = 0; i < shares(); ++i) {
        const uint64_t v = spans_[i].bits.load(std::memory_order_relaxed);
        if (back(v) > front(v) + most) most = back(v) - front(v), victim = i;
      }
      if (victim < 0) return false;
      std::atomic<uint64_t>& span = spans_[victim].bits;
      uint64_t v = span.load(std::memory_order_relaxed);
      while (back(v) > front(v) + 1) {
        const uint64_t cut = back(v) - (back(v) - front(v)) / 2;
        if (span.compare_exchange_weak(v, pack(front(v), cut), std::memory_order_relaxed)) {
          spans_[thief].set(cut, back(v));  // nothing takes from an empty share, so a plain store is safe
          return true;
        }
      }
    }
  }

 private:
  // [front, back) of one share, as one word (front in the low half) so that its owner's claims at the front and a
  // thief's cut at the back are one compare-and-swap apart; a cache line each, so owners do not share lines.
  struct alignas(64) Span {
    std::atomic<uint64_t> bits{0};
    void set(uint64_t f, uint64_t b) { bits.store(pack(f, b), std::memory_order_relaxed); }
  };
  static uint64_t pack(uint64_t f, uint64_t b) { return f | (b << 32); }
  static uint64_t front(uint64_t v) { return v & 0xFFFFFFFFu; }
  static uint64_t back(uint64_t v) { return v >> 32; }

  std::vector<Span> spans_;
};

// body(t) for every tile t in [0, tiles), each once, over torch's threads as TileShares splits them.
template <typename Body>
void for_each_tile(int64_t tiles, const Body& body) {
  TileShares shares(tiles, std::clamp<int64_t>(at::get_num_threads(), 1, std::max<int64_t>(tiles, 1)));
  at::parallel_for(0, shares.shares(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // one share a thread; all of them, in turn, where the call runs serially
      int64_t t;
      do {
        while (shares.next(i, t)) body(t);
      } while (shares.steal(i));
    }
  });
}

}  // namespace kvserve
