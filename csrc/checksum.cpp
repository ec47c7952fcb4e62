// kvsum64 (definition in checksum.h).
#include "checksum.h"

#include <cstring>

namespace kvcopy {

namespace {

inline std::uint64_t fmix(std::uint64_t x) {
    // MurmurHash3's 64-bit finaliser: a bijection with full avalanche.
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ull;
    x ^= x >> 33;
    return x;
}

inline std::uint64_t load_le64(const unsigned char* p) {
    std::uint64_t v;
    std::memcpy(&v, p, 8);  // unaligned-safe; compiles to one load
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

}  // namespace

std::uint64_t checksum(const void* data, std::size_t length, std::uint64_t seed) {
    const auto* p = static_cast<const unsigned char*>(data);
    const std::size_t words = length / 8;
    // Four independent accumulators let the CPU overlap the multiply chains; addition is
    // associative, so the result equals a single running sum.
    std::uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    std::uint64_t key = 0;  // (i + 1) * P1, advanced incrementally
    std::size_t i = 0;
    for (; i + 4 <= words; i += 4) {
        const unsigned char* q = p + i * 8;
        a0 += fmix(load_le64(q) ^ seed ^ (key += kSumP1));
        a1 += fmix(load_le64(q + 8) ^ seed ^ (key += kSumP1));
        a2 += fmix(load_le64(q + 16) ^ seed ^ (key += kSumP1));
        a3 += fmix(load_le64(q + 24) ^ seed ^ (key += kSumP1));
    }
    for (; i < words; ++i) a0 += fmix(load_le64(p + i * 8) ^ seed ^ (key += kSumP1));
    std::uint64_t acc = a0 + a1 + a2 + a3;

    const std::size_t rest = length % 8;
    if (rest != 0) {
        unsigned char buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        std::memcpy(buf, p + words * 8, rest);
        acc += fmix(load_le64(buf) ^ seed ^ (key + kSumP1) ^ kSumP2);
    }
    return fmix(acc ^ seed ^ ((static_cast<std::uint64_t>(length) + 1) * kSumP2));
}

}  // namespace kvcopy
