// Fused copy + per-object kvsum64 (see checksum_copy.h).
//
// Each thread takes a byte range of the concatenated pieces (as batch_copy) and walks it in steps of
// at most kStep (4 KiB) bytes, cut at multiples of kStep in object coordinates: copy the step, then sum the
// words of the step from the source, which the copy has just brought into cache. The source bytes
// are the bytes written, so for a gather the sum is over what landed in the object and for a
// scatter over what the engine received.
#include "checksum_copy.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "checksum.h"

namespace kvcopy {

namespace {

// A multiple of 8. One 4 KiB step is re-read from L1 for the sum. Measured on the dev VM (256 MiB,
// torch-allocated KV with 4 KiB pages): 64 KiB steps cost 12-18% against the plain copy, 16 KiB
// steps 24% on scatter, 4 KiB steps none (faster than the plain kernel's interleaved streams there).
constexpr std::uint64_t kStep = 4096;

struct Sums {
    std::vector<std::uint64_t> acc;                           // per object
    std::vector<std::pair<std::uint32_t, std::uint64_t>> cut;  // (object, word) summed afterwards
};

// Sums the whole words of object bytes [a, b) found at `p` (the byte at object offset a); words cut
// by a or b are recorded for later. Only the n / 8 whole words of an object are summed here (the
// tail is checksum_finish's job).
void sum_span(const unsigned char* p, std::uint64_t a, std::uint64_t b, std::uint64_t whole, std::uint32_t obj,
              std::uint64_t seed, Sums& s) {
    if (a >= b) return;
    const std::uint64_t wa = (a + 7) / 8, wb = std::min(b / 8, whole);
    if (a % 8 != 0 && a / 8 < whole) s.cut.emplace_back(obj, a / 8);
    if (b % 8 != 0 && b / 8 < whole) s.cut.emplace_back(obj, b / 8);
    if (wb > wa) s.acc[obj] += sum_words_at(p + (wa * 8 - a), static_cast<std::size_t>(wb - wa), wa, seed);
}

void run_range(const ChecksumPlan& plan, const std::vector<std::uint64_t>& ends, std::uint64_t lo,
               std::uint64_t hi, bool stream, std::uint64_t seed, Sums& s) {
    if (lo >= hi) return;
    const auto& pieces = plan.pieces;
    std::size_t i = static_cast<std::size_t>(std::upper_bound(ends.begin(), ends.end(), lo) - ends.begin());
    std::uint64_t pos = lo;
    while (pos < hi && i < pieces.size()) {
        const auto& pc = pieces[i];
        const std::uint64_t start = ends[i] - pc.len;
        std::uint64_t from = pos - start;
        const std::uint64_t to = std::min(ends[i], hi) - start;
        const std::uint64_t whole = plan.objects[pc.obj].len / 8;
        while (from < to) {
            const std::uint64_t oa = pc.obj_off + from;
            const std::uint64_t ob = std::min(pc.obj_off + to, (oa / kStep + 1) * kStep);
            const std::uint64_t n = ob - oa;
            const auto* src = reinterpret_cast<const unsigned char*>(pc.src + from);
            copy_bytes(reinterpret_cast<void*>(pc.dst + from), src, static_cast<std::size_t>(n), stream);
            sum_span(src, oa, ob, whole, pc.obj, seed, s);
            from += n;
        }
        pos = start + to;
        ++i;
    }
    if (stream) store_fence();
}

}  // namespace

ChecksumPlan plan_checksum_copy(const std::vector<Segment>& segments, std::vector<ObjectSpan> objects,
                                bool object_is_dst) {
    ChecksumPlan plan;
    plan.object_is_dst = object_is_dst;
    if (objects.size() > 0xFFFFFFFFull) throw std::invalid_argument("too many objects");
    std::vector<std::uint32_t> order(objects.size());
    std::iota(order.begin(), order.end(), 0u);
    std::sort(order.begin(), order.end(), [&](auto x, auto y) { return objects[x].addr < objects[y].addr; });
    for (std::size_t k = 1; k < order.size(); ++k) {
        const auto& prev = objects[order[k - 1]];
        if (prev.addr + prev.len > objects[order[k]].addr)
            throw std::invalid_argument("objects overlap");
    }
    std::vector<std::uint64_t> starts(order.size());
    for (std::size_t k = 0; k < order.size(); ++k) starts[k] = objects[order[k]].addr;

    std::vector<std::vector<std::pair<std::uint64_t, std::uint64_t>>> covered(objects.size());
    for (std::size_t i = 0; i < segments.size(); ++i) {
        Segment seg = segments[i];
        while (seg.len > 0) {
            const std::uint64_t at = object_is_dst ? seg.dst : seg.src;
            auto it = std::upper_bound(starts.begin(), starts.end(), at);
            const std::size_t k = static_cast<std::size_t>(it - starts.begin());
            if (k == 0 || at >= objects[order[k - 1]].addr + objects[order[k - 1]].len)
                throw std::invalid_argument("segment " + std::to_string(i) + ": its object side is in no object");
            const std::uint32_t obj = order[k - 1];
            const std::uint64_t off = at - objects[obj].addr;
            const std::uint64_t n = std::min(seg.len, objects[obj].len - off);
            plan.pieces.push_back({seg.src, seg.dst, n, obj, off});
            covered[obj].emplace_back(off, off + n);
            seg.src += n;
            seg.dst += n;
            seg.len -= n;
        }
    }
    for (std::uint32_t obj = 0; obj < covered.size(); ++obj) {
        auto& c = covered[obj];
        std::sort(c.begin(), c.end());
        std::uint64_t pos = 0;
        for (const auto& [a, b] : c) {
            if (a < pos) throw std::invalid_argument("two segments cover the same object bytes");
            if (a > pos) plan.gaps.push_back({obj, pos, a});
            pos = b;
        }
        if (pos < objects[obj].len) plan.gaps.push_back({obj, pos, objects[obj].len});
    }
    plan.objects = std::move(objects);
    return plan;
}

std::vector<std::uint64_t> copy_checksum(const ChecksumPlan& plan, unsigned requested_threads, std::uint64_t seed) {
    const auto& pieces = plan.pieces;
    std::vector<std::uint64_t> ends(pieces.size());
    std::uint64_t total = 0;
    for (std::size_t i = 0; i < pieces.size(); ++i) ends[i] = total += pieces[i].len;

    const unsigned n = total == 0 ? 1 : plan_threads(total, requested_threads);
    const bool stream = plan_streaming(total);
    std::vector<Sums> sums(n);
    for (auto& s : sums) s.acc.assign(plan.objects.size(), 0);
    // Part t covers [bound(t), bound(t+1)), cut at 64-byte multiples of the stream (fewer cut words).
    auto bound = [&](unsigned t) -> std::uint64_t {
        if (t >= n) return total;
        const std::uint64_t q = total / n, r = total % n;
        return (q * t + std::min<std::uint64_t>(t, r)) & ~std::uint64_t{63};
    };
    std::vector<std::thread> workers;
    std::vector<unsigned> inline_parts;
    for (unsigned t = 1; t < n; ++t) {
        try {
            workers.emplace_back(run_range, std::cref(plan), std::cref(ends), bound(t), bound(t + 1), stream, seed,
                                 std::ref(sums[t]));
        } catch (const std::system_error&) {
            inline_parts.push_back(t);
        }
    }
    run_range(plan, ends, bound(0), bound(1), stream, seed, sums[0]);
    for (unsigned t : inline_parts) run_range(plan, ends, bound(t), bound(t + 1), stream, seed, sums[t]);
    for (auto& w : workers) w.join();

    Sums& all = sums[0];
    for (unsigned t = 1; t < n; ++t) {
        for (std::size_t k = 0; k < all.acc.size(); ++k) all.acc[k] += sums[t].acc[k];
        all.cut.insert(all.cut.end(), sums[t].cut.begin(), sums[t].cut.end());
    }
    // Bytes no segment covers are summed straight from the object.
    for (const auto& g : plan.gaps) {
        const auto& o = plan.objects[g.obj];
        sum_span(reinterpret_cast<const unsigned char*>(o.addr) + g.lo, g.lo, g.hi, o.len / 8, g.obj, seed, all);
    }
    // Each word cut by a boundary once, read from the object (complete now: the copy is done).
    std::sort(all.cut.begin(), all.cut.end());
    all.cut.erase(std::unique(all.cut.begin(), all.cut.end()), all.cut.end());
    for (const auto& [obj, w] : all.cut)
        all.acc[obj] += word_term(reinterpret_cast<const void*>(plan.objects[obj].addr + 8 * w), w, seed);
    std::vector<std::uint64_t> out(plan.objects.size());
    for (std::size_t k = 0; k < out.size(); ++k) {
        const auto& o = plan.objects[k];
        out[k] = checksum_finish(all.acc[k], reinterpret_cast<const void*>(o.addr), static_cast<std::size_t>(o.len),
                                 seed);
    }
    return out;
}

}  // namespace kvcopy
