// kvsum64: the project's fast 64-bit content checksum (integrity, not security).
//
// Why this algorithm and not XXH64: every 8-byte word is mixed independently and the results are
// summed, so the same value can be computed by a vectorised numpy fallback (and split across threads
// or SIMD lanes) with identical results; XXH64's serial lane chains cannot be vectorised in numpy.
//
// Exact definition (all arithmetic modulo 2^64, words little-endian):
//   P1 = 0x9E3779B97F4A7C15, P2 = 0xC2B2AE3D27D4EB4F
//   fmix(x): x ^= x >> 33; x *= 0xFF51AFD7ED558CCD; x ^= x >> 33; x *= 0xC4CEB9FE1A85EC53; x ^= x >> 33
//   n = length in bytes, W = n / 8, w_i = i-th 8-byte word of the input (i = 0 .. W-1)
//   acc = sum_{i<W} fmix(w_i ^ seed ^ ((i + 1) * P1))
//   if n % 8 != 0: t = the last n % 8 bytes, zero-padded to a little-endian word
//                  acc += fmix(t ^ seed ^ ((W + 1) * P1) ^ P2)
//   result = fmix(acc ^ seed ^ ((n + 1) * P2))
// Position enters through the per-word key, so reordering words changes the result; length enters
// the finaliser, so trailing zero bytes change it too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kvcopy {

constexpr std::uint64_t kSumP1 = 0x9E3779B97F4A7C15ull;
constexpr std::uint64_t kSumP2 = 0xC2B2AE3D27D4EB4Full;

std::uint64_t checksum(const void* data, std::size_t length, std::uint64_t seed);

// kvsum64 in pieces (the sum over words is associative, so any split gives the same value):
//   acc = sum of sum_words_at(...) over disjoint word ranges covering words 0 .. n/8 - 1, plus
//         word_term(...) for single words; then checksum_finish(acc, object, n, seed).
// sum_words_at: sum_{j<words} fmix(w_j ^ seed ^ ((first + j + 1) * P1)), w_j read at data + 8j.
std::uint64_t sum_words_at(const void* data, std::size_t words, std::uint64_t first, std::uint64_t seed);
// The term of one word (8 bytes at `word`) at word index `index` of its object.
std::uint64_t word_term(const void* word, std::uint64_t index, std::uint64_t seed);
// Adds the tail term (the object's last n % 8 bytes) and applies the finaliser.
std::uint64_t checksum_finish(std::uint64_t acc, const void* object, std::size_t length, std::uint64_t seed);

// The checksum computed by every compiled version the running CPU supports (name, value), best
// first; the first is what checksum() uses. For tests: all values must be equal.
std::vector<std::pair<std::string, std::uint64_t>> checksum_all_versions(const void* data, std::size_t length,
                                                                         std::uint64_t seed);

}  // namespace kvcopy
