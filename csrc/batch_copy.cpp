// Batched segment copy (see batch_copy.h).
//
// Work split: the segments are treated as one concatenated byte stream of `total` bytes. Thread t
// gets the byte range [t*total/n, (t+1)*total/n) of that stream, which may start or end in the
// middle of a segment. This balances the threads by bytes exactly, whatever the mix of segment
// sizes (one huge segment is split too), and keeps each thread's accesses sequential.
#include "batch_copy.h"

#include <algorithm>
#include <cstring>
#include <system_error>
#include <thread>

namespace kvcopy {

unsigned default_threads() {
    unsigned hw = std::thread::hardware_concurrency();  // 0 when unknown
    if (hw == 0) hw = 1;
    return std::min(hw, kMaxDefaultThreads);
}

unsigned plan_threads(std::uint64_t total_bytes, unsigned requested) {
    unsigned n = requested == 0 ? default_threads() : requested;
    // Never give a thread less than kMinBytesPerThread: small copies stay on the calling thread.
    std::uint64_t by_size = total_bytes / kMinBytesPerThread;
    if (by_size < n) n = static_cast<unsigned>(std::max<std::uint64_t>(by_size, 1));
    return n;
}

namespace {

// Copies bytes [lo, hi) of the concatenated stream. `ends[i]` is the stream offset one past the
// last byte of segment i (an inclusive prefix sum of the lengths).
void copy_range(const std::vector<Segment>& segs, const std::vector<std::uint64_t>& ends,
                std::uint64_t lo, std::uint64_t hi) {
    if (lo >= hi) return;
    // First segment whose end lies beyond `lo`: the one that contains byte `lo`.
    std::size_t i = static_cast<std::size_t>(
        std::upper_bound(ends.begin(), ends.end(), lo) - ends.begin());
    std::uint64_t pos = lo;
    while (pos < hi && i < segs.size()) {
        const Segment& s = segs[i];
        const std::uint64_t seg_start = ends[i] - s.len;
        const std::uint64_t from = pos - seg_start;                  // offset inside segment
        const std::uint64_t to = std::min(ends[i], hi) - seg_start;  // end offset inside segment
        if (to > from) {
            std::memcpy(reinterpret_cast<void*>(s.dst + from),
                        reinterpret_cast<const void*>(s.src + from),
                        static_cast<std::size_t>(to - from));
        }
        pos = seg_start + to;
        ++i;
    }
}

}  // namespace

void batch_copy(const std::vector<Segment>& segs, unsigned requested_threads) {
    std::vector<std::uint64_t> ends(segs.size());
    std::uint64_t total = 0;
    for (std::size_t i = 0; i < segs.size(); ++i) {
        total += segs[i].len;
        ends[i] = total;
    }
    if (total == 0) return;

    const unsigned n = plan_threads(total, requested_threads);
    if (n == 1) {
        copy_range(segs, ends, 0, total);
        return;
    }
    // Part t covers [bound(t), bound(t+1)). Dividing first (instead of total*t/n) cannot overflow;
    // the remainder r is spread one byte each over the first r parts.
    auto bound = [&](unsigned t) -> std::uint64_t {
        const std::uint64_t q = total / n, r = total % n;
        return q * t + std::min<std::uint64_t>(t, r);
    };
    std::vector<std::thread> workers;
    workers.reserve(n - 1);
    std::vector<unsigned> inline_parts;  // parts we could not hand to a thread
    for (unsigned t = 1; t < n; ++t) {
        try {
            workers.emplace_back(copy_range, std::cref(segs), std::cref(ends), bound(t), bound(t + 1));
        } catch (const std::system_error&) {
            inline_parts.push_back(t);  // out of threads: do this part ourselves
        }
    }
    copy_range(segs, ends, bound(0), bound(1));  // the calling thread takes part 0
    for (unsigned t : inline_parts) copy_range(segs, ends, bound(t), bound(t + 1));
    for (auto& w : workers) w.join();
}

}  // namespace kvcopy
