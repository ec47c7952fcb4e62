// kvsum64 (definition in checksum.h).
//
// Speed: the word loop is written so the compiler can vectorise it (each word is independent, the
// sum is a reduction, the key an induction variable). x86-64 has no 64-bit vector multiply before
// AVX-512DQ, so the same loop is compiled three times (AVX-512DQ, AVX2, baseline) and the best one
// for the running CPU is picked once at load time. Addition mod 2^64 is associative, so every
// version, and the numpy fallback, produce the same value.
#include "checksum.h"

#include <cstring>
#include <string>
#include <utility>
#include <vector>

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

// sum_{i<words} fmix(w_i ^ seed ^ ((first + i + 1) * P1)), the body of every compiled version.
#define KVCOPY_SUM_WORDS_BODY                                      \
    {                                                              \
        std::uint64_t acc = 0, key = (first + 1) * kSumP1;         \
        for (std::size_t i = 0; i < words; ++i) {                  \
            acc += fmix(load_le64(p + 8 * i) ^ seed ^ key);        \
            key += kSumP1;                                         \
        }                                                          \
        return acc;                                                \
    }

using SumWordsFn = std::uint64_t (*)(const unsigned char*, std::size_t, std::uint64_t, std::uint64_t);

std::uint64_t sum_words_base(const unsigned char* p, std::size_t words, std::uint64_t seed, std::uint64_t first)
    KVCOPY_SUM_WORDS_BODY

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2"))) std::uint64_t sum_words_avx2(const unsigned char* p, std::size_t words,
                                                             std::uint64_t seed, std::uint64_t first)
    KVCOPY_SUM_WORDS_BODY

__attribute__((target("avx512f,avx512dq"))) std::uint64_t sum_words_avx512(
    const unsigned char* p, std::size_t words, std::uint64_t seed, std::uint64_t first)
    KVCOPY_SUM_WORDS_BODY

// The versions the running CPU can execute, best first.
std::vector<std::pair<const char*, SumWordsFn>> usable_versions() {
    __builtin_cpu_init();
    std::vector<std::pair<const char*, SumWordsFn>> out;
    if (__builtin_cpu_supports("avx512dq")) out.emplace_back("avx512", sum_words_avx512);
    if (__builtin_cpu_supports("avx2")) out.emplace_back("avx2", sum_words_avx2);
    out.emplace_back("base", sum_words_base);
    return out;
}
#else
std::vector<std::pair<const char*, SumWordsFn>> usable_versions() { return {{"base", sum_words_base}}; }
#endif

const SumWordsFn g_sum_words = usable_versions().front().second;

std::uint64_t finish_with(std::uint64_t acc, const unsigned char* p, std::size_t length, std::uint64_t seed) {
    const std::size_t words = length / 8;
    const std::size_t rest = length % 8;
    if (rest != 0) {
        unsigned char buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        std::memcpy(buf, p + words * 8, rest);
        const std::uint64_t key = (static_cast<std::uint64_t>(words) + 1) * kSumP1;
        acc += fmix(load_le64(buf) ^ seed ^ key ^ kSumP2);
    }
    return fmix(acc ^ seed ^ ((static_cast<std::uint64_t>(length) + 1) * kSumP2));
}

std::uint64_t checksum_with(SumWordsFn sum_words, const void* data, std::size_t length, std::uint64_t seed) {
    const auto* p = static_cast<const unsigned char*>(data);
    return finish_with(sum_words(p, length / 8, seed, 0), p, length, seed);
}

}  // namespace

std::uint64_t sum_words_at(const void* data, std::size_t words, std::uint64_t first, std::uint64_t seed) {
    return g_sum_words(static_cast<const unsigned char*>(data), words, seed, first);
}

std::uint64_t word_term(const void* word, std::uint64_t index, std::uint64_t seed) {
    return fmix(load_le64(static_cast<const unsigned char*>(word)) ^ seed ^ ((index + 1) * kSumP1));
}

std::uint64_t checksum_finish(std::uint64_t acc, const void* object, std::size_t length, std::uint64_t seed) {
    return finish_with(acc, static_cast<const unsigned char*>(object), length, seed);
}

std::uint64_t checksum(const void* data, std::size_t length, std::uint64_t seed) {
    return checksum_with(g_sum_words, data, length, seed);
}

std::vector<std::pair<std::string, std::uint64_t>> checksum_all_versions(const void* data, std::size_t length,
                                                                         std::uint64_t seed) {
    std::vector<std::pair<std::string, std::uint64_t>> out;
    for (const auto& [name, fn] : usable_versions()) out.emplace_back(name, checksum_with(fn, data, length, seed));
    return out;
}

}  // namespace kvcopy
