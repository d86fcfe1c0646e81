/* MLX arrays over the pages of a mapped weight file: a tensor held as stored costs no copy and no new
 * memory, only the mapping of pages the page cache already holds (or reads once, cold).
 *
 * Why: a load that copies every tensor into new memory pays for fresh pages, which cost more than the
 * read itself (a 2.15 GB bf16 folder in the page cache: reading it 0.3-0.45 s, mapping all its pages
 * 0.03 s). llama.cpp maps its GGUF files the same way by default.
 *
 * How: each file is mapped once, whole, read-only (MAP_PRIVATE, PROT_READ: a writable private mapping
 * would count against the commit limit); an array's MLX buffer is not owned by MLX's allocator (allocator::Data
 * with our deleter), so MLX never donates it to an operation's output, and our in-place repack leaves it
 * alone (it checks is_owned()). Each array keeps its file's mapping alive; when it dies its own pages are
 * dropped from this process (MADV_DONTNEED: they stay in the page cache), so a weight replaced after
 * loading (repacked, re-quantized) stops counting in the rank's resident memory. The file must not change
 * while mapped (as with llama.cpp's mmap). */
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "kernels_common.h"

namespace nb = nanobind;

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14
#endif

namespace {

struct Mapping {
    char *base = nullptr;
    size_t length = 0;
    ~Mapping() {
        if (base) munmap(base, length);
    }
};

std::mutex g_lock;
std::map<std::pair<dev_t, ino_t>, std::weak_ptr<Mapping>> g_mappings;  // one mapping per file while in use

const long g_page = sysconf(_SC_PAGESIZE);

// Buffer::raw_ptr() is the data pointer; some MLX builds keep a size header before it: the offset to undo
ptrdiff_t header_bytes() {
    static char probe[64];
    static const ptrdiff_t bytes = static_cast<char *>(mx::allocator::Buffer(probe + 32).raw_ptr()) - (probe + 32);
    return bytes;
}

std::shared_ptr<Mapping> map_file(const std::string &path, size_t need) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw std::runtime_error(path + ": " + std::strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        const int e = errno;
        close(fd);
        throw std::runtime_error(path + ": " + std::strerror(e));
    }
    if (need > size_t(st.st_size)) {
        close(fd);
        throw std::runtime_error(path + " is shorter than its header says");
    }
    const auto key = std::make_pair(st.st_dev, st.st_ino);
    std::lock_guard<std::mutex> guard(g_lock);
    if (auto live = g_mappings[key].lock(); live && live->length == size_t(st.st_size)) {
        close(fd);
        return live;
    }
    // read-only: a writable private mapping would count the whole file against the commit limit (a file
    // larger than RAM + swap, or strict overcommit, would fail); nothing writes here (MLX and our in-place
    // paths leave buffers they do not own alone)
    void *base = mmap(nullptr, st.st_size, PROT_READ, MAP_PRIVATE | MAP_NORESERVE, fd, 0);
    const int e = errno;
    close(fd);  // the mapping keeps the file
    if (base == MAP_FAILED) throw std::runtime_error(path + ": mmap: " + std::strerror(e));
    auto mapping = std::make_shared<Mapping>();
    mapping->base = static_cast<char *>(base);
    mapping->length = st.st_size;
    g_mappings[key] = mapping;
    return mapping;
}

// the whole pages inside [begin, end): the pages no other tensor shares
std::pair<char *, size_t> inner_pages(char *begin, char *end) {
    const uintptr_t first = (reinterpret_cast<uintptr_t>(begin) + g_page - 1) / g_page * g_page;
    const uintptr_t last = reinterpret_cast<uintptr_t>(end) / g_page * g_page;
    return {reinterpret_cast<char *>(first), last > first ? last - first : 0};
}

/* The tensor at bytes [offset, offset + nbytes) of `path` as an MLX array of `shape` and `dtype`, its pages
   mapped now (read from disk if the page cache lacks them), no copy. */
mx::array mapped_array(const std::string &path, int64_t offset, const std::vector<int> &shape, mx::Dtype dtype) {
    int64_t count = 1;
    for (int d : shape) count *= d;
    const size_t nbytes = size_t(count) * mx::size_of(dtype);
    if (offset < 0) throw std::invalid_argument("negative offset");
    if (offset % mx::size_of(dtype) != 0) throw std::invalid_argument("offset not aligned to the dtype");
    auto mapping = map_file(path, size_t(offset) + nbytes);
    char *data = mapping->base + offset;
    const uintptr_t page_start = reinterpret_cast<uintptr_t>(data) / g_page * g_page;
    const size_t populate = reinterpret_cast<uintptr_t>(data + nbytes) - page_start;
    if (nbytes && madvise(reinterpret_cast<void *>(page_start), populate, MADV_POPULATE_READ) != 0) {
        volatile const char *p = data;  // a kernel before 5.14: touch each page
        char sink = 0;
        for (size_t i = 0; i < nbytes; i += g_page) sink ^= p[i];
        (void)sink;
    }
    mx::allocator::Buffer buffer(data - header_bytes());
    if (buffer.raw_ptr() != data) throw std::runtime_error("this MLX build's buffers cannot wrap mapped pages");
    auto deleter = [mapping, data, nbytes](mx::allocator::Buffer) {
        auto [pages, length] = inner_pages(data, data + nbytes);
        if (length) madvise(pages, length, MADV_DONTNEED);  // out of this process; still in the page cache
    };
    return mx::array(mx::allocator::Data(buffer, deleter), mx::Shape(shape.begin(), shape.end()), dtype);
}

}  // namespace

void register_mapped(nb::module_ &m) {
    // without the GIL: populating a cold tensor's pages is a disk read, during which the loader's other
    // Python threads (a GGUF's decoders, the progress bar) go on
    m.def("mapped_array", &mapped_array, nb::arg("path"), nb::arg("offset"), nb::arg("shape"), nb::arg("dtype"),
          nb::call_guard<nb::gil_scoped_release>(), "bytes [offset, offset + size) of a file as an array, without a copy (mapped_files.cpp)");
    m.def("mapped_files", []() {
        std::lock_guard<std::mutex> guard(g_lock);
        int64_t live = 0;
        for (auto &[key, weak] : g_mappings) live += !weak.expired();
        return live;
    }, "how many files are mapped now (tests)");
}
