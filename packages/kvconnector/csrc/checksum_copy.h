// Batched segment copy that also computes the kvsum64 of every object it fills or reads.
//
// Why fused: the copy between an engine's paged KV and cache objects is memory-bound, so summing the
// bytes while they are in cache anyway costs little, and a load can check that what it delivered is
// what was stored (docs/engine.md "Verified reads").
//
// How the per-object checksum composes: kvsum64 is a sum (mod 2^64) of independent per-word terms
// keyed by the word's index in its object (checksum.h), so each thread sums the words of the bytes
// it copies, at their object positions, into a per-thread, per-object accumulator. Words cut by a
// piece boundary that is not 8-byte aligned in object coordinates, and object bytes no segment
// covers (a load that starts in the middle of an object), are summed from the object afterwards;
// the thread count and the work split therefore never change the result.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "batch_copy.h"

namespace kvcopy {

// One object: `len` bytes at absolute address `addr` (on the destination side for a gather, on the
// source side for a scatter).
struct ObjectSpan {
    std::uint64_t addr;
    std::uint64_t len;
};

// A validated plan: segments cut at object boundaries, each with its object and offset in it.
struct ChecksumPlan {
    struct Piece {
        std::uint64_t src, dst, len;
        std::uint32_t obj;
        std::uint64_t obj_off;
    };
    struct Gap {  // object bytes [lo, hi) that no segment covers
        std::uint32_t obj;
        std::uint64_t lo, hi;
    };
    std::vector<Piece> pieces;
    std::vector<Gap> gaps;
    std::vector<ObjectSpan> objects;
    bool object_is_dst = true;
};

// Checks and cuts: objects must be disjoint; every segment's object side must lie in objects (it may
// run on into an adjacent object, and is cut there); no object byte may be covered twice. Throws
// std::invalid_argument otherwise.
ChecksumPlan plan_checksum_copy(const std::vector<Segment>& segments, std::vector<ObjectSpan> objects,
                                bool object_is_dst);

// Copies every piece of the plan (threads and streaming as batch_copy) and returns the kvsum64 of
// every object, in the order the objects were given. Does not touch Python (GIL may be released).
std::vector<std::uint64_t> copy_checksum(const ChecksumPlan& plan, unsigned requested_threads, std::uint64_t seed);

}  // namespace kvcopy
