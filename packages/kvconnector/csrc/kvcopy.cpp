// Python bindings for the kvconnector copy kernels: `kvconnector._kvcopy`.
//
// Why a thin layer: all argument checking happens here, with the GIL held, and turns bad input into
// ValueError/TypeError; the kernels below (batch_copy.cpp, checksum.cpp) then run on plain C++ data
// with the GIL released, so other Python threads (the engine, the ZMQ client) keep running.
// No torch headers: callers pass raw addresses (tensor.data_ptr(), numpy/mmap buffer addresses).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "batch_copy.h"
#include "checksum.h"
#include "checksum_copy.h"

namespace py = pybind11;

namespace {

// Owns a Py_buffer for its lifetime (released in the destructor, GIL held by the caller).
class BufferGuard {
  public:
    BufferGuard(PyObject* obj, int flags) {
        if (PyObject_GetBuffer(obj, &view_, flags) != 0) throw py::error_already_set();
    }
    ~BufferGuard() { PyBuffer_Release(&view_); }
    BufferGuard(const BufferGuard&) = delete;
    BufferGuard& operator=(const BufferGuard&) = delete;
    const Py_buffer& view() const { return view_; }

  private:
    Py_buffer view_{};
};

// The element type of a buffer format string, without its native/little-endian prefix ("<q" -> 'q').
// Returns 0 for formats we never accept (big-endian, structs, multi-char codes).
char base_format(const char* fmt) {
    if (fmt == nullptr) return 'B';  // no format requested/given means unsigned bytes
    std::string f(fmt);
    if (!f.empty() && (f[0] == '@' || f[0] == '=' || f[0] == '<')) f.erase(0, 1);
    return f.size() == 1 ? f[0] : 0;
}

std::int64_t read_i64(const char* p) {
    std::int64_t v;
    std::memcpy(&v, p, 8);  // the bytes-like path may be unaligned
    return v;
}

// Reads an (n, cols) int64 table (cols = 3 for segments, 2 for objects): a 2-D (n, cols) int64
// array (any strides), a 1-D int64 array of cols*n values, or a contiguous bytes-like object of n
// native-endian int64 tuples.
std::vector<std::int64_t> read_table(const py::object& segments, Py_ssize_t cols, const char* what) {
    BufferGuard guard(segments.ptr(), PyBUF_RECORDS_RO);
    const Py_buffer& v = guard.view();
    const char fmt = base_format(v.format);
    const auto* base = static_cast<const char*>(v.buf);
    std::vector<std::int64_t> out;

    if (v.itemsize == 8 && (fmt == 'q' || fmt == 'l')) {
        if (v.ndim == 2) {
            if (v.shape[1] != cols)
                throw py::value_error(std::string(what) + " must have shape (n, " + std::to_string(cols) +
                                      "), got second dimension " + std::to_string(v.shape[1]));
            const Py_ssize_t n = v.shape[0];
            out.resize(static_cast<std::size_t>(n) * cols);
            for (Py_ssize_t i = 0; i < n; ++i)
                for (Py_ssize_t j = 0; j < cols; ++j)
                    out[i * cols + j] = read_i64(base + i * v.strides[0] + j * v.strides[1]);
        } else if (v.ndim == 1) {
            if (v.shape[0] % cols != 0)
                throw py::value_error(std::string("a 1-D ") + what + " array must hold a multiple of " +
                                      std::to_string(cols) + " values");
            out.resize(static_cast<std::size_t>(v.shape[0]));
            for (Py_ssize_t k = 0; k < v.shape[0]; ++k) out[k] = read_i64(base + k * v.strides[0]);
        } else {
            throw py::value_error(std::string(what) + " must be a (n, " + std::to_string(cols) +
                                  ") array, got ndim " + std::to_string(v.ndim));
        }
    } else if (v.itemsize == 1 && (fmt == 'B' || fmt == 'b' || fmt == 'c')) {
        if (!PyBuffer_IsContiguous(&v, 'C'))
            throw py::value_error(std::string("a bytes-like ") + what + " table must be C-contiguous");
        if (v.len % (8 * cols) != 0)
            throw py::value_error(std::string("a bytes-like ") + what + " table must hold whole int64 " +
                                  (cols == 3 ? "triples (24 bytes each)" : "pairs (16 bytes each)"));
        out.resize(static_cast<std::size_t>(v.len / 8));
        for (std::size_t k = 0; k < out.size(); ++k) out[k] = read_i64(base + k * 8);
    } else {
        throw py::value_error(std::string(what) + std::string(" must be int64 (or raw bytes), got format '") +
                              (v.format ? v.format : "B") + "' itemsize " + std::to_string(v.itemsize));
    }
    return out;
}

std::uint64_t checked_address(std::int64_t base, std::int64_t off, std::int64_t len, std::size_t i,
                              const char* side) {
    std::uint64_t addr = 0, end = 0;
    if (__builtin_add_overflow(static_cast<std::uint64_t>(base), static_cast<std::uint64_t>(off), &addr) ||
        __builtin_add_overflow(addr, static_cast<std::uint64_t>(len), &end))
        throw py::value_error("segment " + std::to_string(i) + ": " + side + " address overflows");
    if (addr == 0 && len > 0)
        throw py::value_error("segment " + std::to_string(i) + ": " + side + " address is null");
    return addr;
}

// Checks the arguments every copy takes and turns the segment table into absolute segments.
std::vector<kvcopy::Segment> read_segments(std::int64_t src_base, std::int64_t dst_base, const py::object& segments,
                                           int num_threads, std::uint64_t& total) {
    if (src_base < 0 || dst_base < 0) throw py::value_error("base addresses must be >= 0");
    if (num_threads < 0 || num_threads > 1024) throw py::value_error("num_threads must be in [0, 1024]");
    const std::vector<std::int64_t> table = read_table(segments, 3, "segments");
    const std::size_t n = table.size() / 3;

    std::vector<kvcopy::Segment> segs;
    segs.reserve(n);
    total = 0;
    for (std::size_t i = 0; i < n; ++i) {
        const std::int64_t so = table[3 * i], d_o = table[3 * i + 1], len = table[3 * i + 2];
        if (so < 0 || d_o < 0 || len < 0)
            throw py::value_error("segment " + std::to_string(i) + " has a negative value (" +
                                  std::to_string(so) + ", " + std::to_string(d_o) + ", " +
                                  std::to_string(len) + ")");
        if (len == 0) continue;
        const std::uint64_t src = checked_address(src_base, so, len, i, "source");
        const std::uint64_t dst = checked_address(dst_base, d_o, len, i, "destination");
        if (__builtin_add_overflow(total, static_cast<std::uint64_t>(len), &total) || total > (1ull << 62))
            throw py::value_error("total segment length is too large");
        segs.push_back({src, dst, static_cast<std::uint64_t>(len)});
    }
    return segs;
}

std::int64_t batch_copy_py(std::int64_t src_base, std::int64_t dst_base, const py::object& segments,
                           int num_threads) {
    std::uint64_t total = 0;
    const std::vector<kvcopy::Segment> segs = read_segments(src_base, dst_base, segments, num_threads, total);
    {
        py::gil_scoped_release nogil;
        kvcopy::batch_copy(segs, static_cast<unsigned>(num_threads));
    }
    return static_cast<std::int64_t>(total);
}

// Copy plus the kvsum64 of every object (see checksum_copy.h); objects are (offset, length) rows
// from the base of `object_side` ("dst" for a gather, "src" for a scatter).
std::vector<std::uint64_t> copy_checksum_py(std::int64_t src_base, std::int64_t dst_base, const py::object& segments,
                                            const py::object& objects, const std::string& object_side,
                                            int num_threads, std::uint64_t seed) {
    if (object_side != "dst" && object_side != "src") throw py::value_error("object_side must be 'dst' or 'src'");
    const bool is_dst = object_side == "dst";
    std::uint64_t total = 0;
    const std::vector<kvcopy::Segment> segs = read_segments(src_base, dst_base, segments, num_threads, total);
    const std::vector<std::int64_t> table = read_table(objects, 2, "objects");
    const std::int64_t base = is_dst ? dst_base : src_base;
    std::vector<kvcopy::ObjectSpan> objs;
    objs.reserve(table.size() / 2);
    for (std::size_t k = 0; k < table.size() / 2; ++k) {
        const std::int64_t off = table[2 * k], len = table[2 * k + 1];
        if (off < 0 || len < 0) throw py::value_error("object " + std::to_string(k) + " has a negative value");
        objs.push_back({checked_address(base, off, len, k, "object"), static_cast<std::uint64_t>(len)});
    }
    kvcopy::ChecksumPlan plan;
    try {
        plan = kvcopy::plan_checksum_copy(segs, std::move(objs), is_dst);
    } catch (const std::invalid_argument& exc) {
        throw py::value_error(exc.what());
    }
    py::gil_scoped_release nogil;
    return kvcopy::copy_checksum(plan, static_cast<unsigned>(num_threads), seed);
}

// Checksums of at least this size release the GIL (below, the release costs more than it frees).
constexpr std::size_t kReleaseGilBytes = 64 * 1024;

std::uint64_t checksum_at(const void* p, std::size_t len, std::uint64_t seed) {
    if (len < kReleaseGilBytes) return kvcopy::checksum(p, len, seed);
    py::gil_scoped_release nogil;
    return kvcopy::checksum(p, len, seed);
}

std::uint64_t checksum_py(std::int64_t addr, std::int64_t length, std::uint64_t seed) {
    if (addr < 0 || length < 0) throw py::value_error("addr and length must be >= 0");
    if (length > 0 && addr == 0) throw py::value_error("addr is null");
    std::uint64_t end = 0;
    if (__builtin_add_overflow(static_cast<std::uint64_t>(addr), static_cast<std::uint64_t>(length), &end))
        throw py::value_error("addr + length overflows");
    return checksum_at(reinterpret_cast<const void*>(addr), static_cast<std::size_t>(length), seed);
}

std::uint64_t checksum_bytes_py(const py::object& buffer, std::uint64_t seed) {
    BufferGuard guard(buffer.ptr(), PyBUF_SIMPLE);  // PyBUF_SIMPLE refuses non-contiguous buffers
    const Py_buffer& v = guard.view();
    return checksum_at(v.buf, static_cast<std::size_t>(v.len), seed);
}

}  // namespace

PYBIND11_MODULE(_kvcopy, m) {
    m.doc() = "kvconnector copy kernels: batched multi-threaded segment copy and the kvsum64 checksum.";
    m.def("batch_copy", &batch_copy_py, py::arg("src_base"), py::arg("dst_base"), py::arg("segments"),
          py::arg("num_threads") = 0,
          "Copy segments[i] = (src_off, dst_off, len): len bytes from src_base+src_off to "
          "dst_base+dst_off, for every row, on up to num_threads threads (0 = default), GIL released. "
          "Destinations must not overlap each other or any source. Returns the bytes copied.");
    m.def("copy_checksum", &copy_checksum_py, py::arg("src_base"), py::arg("dst_base"), py::arg("segments"),
          py::arg("objects"), py::arg("object_side"), py::arg("num_threads") = 0, py::arg("seed") = 0,
          "batch_copy, and the kvsum64 of every object (rows (offset, length) from the object side's base; "
          "object_side 'dst' for a gather, 'src' for a scatter), summed from the bytes as they are copied. "
          "Every segment's object side must lie in the objects; no object byte may be covered twice. "
          "Returns the checksums in object order.");
    m.def("checksum", &checksum_py, py::arg("addr"), py::arg("length"), py::arg("seed") = 0,
          "kvsum64 of `length` bytes at address `addr` (see docs/layouts.md).");
    m.def("checksum_bytes", &checksum_bytes_py, py::arg("buffer"), py::arg("seed") = 0,
          "kvsum64 of a contiguous bytes-like object.");
    m.def("_checksum_versions", [](const py::object& buffer, std::uint64_t seed) {
              BufferGuard guard(buffer.ptr(), PyBUF_SIMPLE);
              return kvcopy::checksum_all_versions(guard.view().buf,
                                                   static_cast<std::size_t>(guard.view().len), seed);
          },
          py::arg("buffer"), py::arg("seed") = 0,
          "[(version, kvsum64)] for every compiled checksum version this CPU runs (tests).");
    m.def("default_threads", []() { return kvcopy::default_threads(); },
          "Threads batch_copy uses for large copies when num_threads=0.");
    m.def("plan_threads", [](std::uint64_t total, unsigned requested) {
              return kvcopy::plan_threads(total, requested);
          },
          py::arg("total_bytes"), py::arg("num_threads") = 0,
          "Threads batch_copy would use for a copy of total_bytes.");
    m.def("plan_streaming", &kvcopy::plan_streaming, py::arg("total_bytes"),
          "Whether a copy of total_bytes would use non-temporal (streaming) stores.");
    m.attr("MIN_BYTES_PER_THREAD") = kvcopy::kMinBytesPerThread;
    m.attr("STREAM_MIN_TOTAL_BYTES") = kvcopy::kStreamMinTotalBytes;
}
