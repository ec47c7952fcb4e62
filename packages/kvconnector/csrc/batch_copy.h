// Batched segment copy: many (src, dst, len) memcpy's, split across threads by bytes.
//
// Why: moving a chunk of paged KV between an engine and the cache arena is a list of a few dozen to
// a few thousand independent block-sized memcpy's. Doing them in one native call, with the GIL
// released and the bytes shared evenly between a handful of threads, is what lets the copy run at
// memory bandwidth instead of at Python-loop speed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvcopy {

// One copy: `len` bytes from absolute address `src` to absolute address `dst`.
struct Segment {
    std::uint64_t src;
    std::uint64_t dst;
    std::uint64_t len;
};

// Below this many bytes per thread a new thread costs more than it saves.
constexpr std::uint64_t kMinBytesPerThread = 1ull << 20;  // 1 MiB
// Upper bound for the default thread count: more threads than this stop helping memcpy.
constexpr unsigned kMaxDefaultThreads = 8;
// Batches of at least this many bytes use non-temporal (streaming) stores for their large
// segments: such a batch does not fit in cache anyway, and streaming stores skip the
// read-for-ownership of every destination line, which is about a third of the memory traffic.
constexpr std::uint64_t kStreamMinTotalBytes = 8ull << 20;  // 8 MiB
// Segments shorter than this are always copied with plain memcpy.
constexpr std::uint64_t kStreamMinSegmentBytes = 4096;

// Whether batch_copy would use streaming stores for a batch of `total_bytes`.
bool plan_streaming(std::uint64_t total_bytes);

// min(std::thread::hardware_concurrency(), kMaxDefaultThreads), at least 1.
unsigned default_threads();

// How many threads a copy of `total_bytes` would use when asked for `requested` (0 = default).
unsigned plan_threads(std::uint64_t total_bytes, unsigned requested);

// One memcpy; with `stream`, segments of at least kStreamMinSegmentBytes use non-temporal stores
// (then call store_fence() before another thread reads the destination).
void copy_bytes(void* dst, const void* src, std::size_t n, bool stream);
void store_fence();

// Copies every segment. Segments must not overlap each other's destination, and no destination
// may overlap any source (plain memcpy semantics). The caller has validated the addresses.
// Does not touch Python; safe to call with the GIL released.
void batch_copy(const std::vector<Segment>& segments, unsigned requested_threads);

}  // namespace kvcopy
