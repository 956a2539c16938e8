// dscore async_io: file reads/writes of host memory through Linux kernel AIO (libaio).
//
// A handle owns `threads` worker threads, each with its own kernel AIO context of `queue_depth` slots.
// One request (a read or write of `nbytes` at `file_offset`) is cut into `threads` contiguous shards
// on `block_size` boundaries; every worker keeps up to `queue_depth` block-sized iocbs of its shard
// in flight. The Python side opens the files (so a missing or read-only path fails with its errno at
// once) and hands over the descriptors: `fd_direct` (O_DIRECT, or -1) and `fd_buffered`. The handle
// closes both when the request completes.
//
// O_DIRECT needs the buffer address, file offset and length aligned to the logical block size; the
// Python side opens `fd_direct` only when the file offset is a multiple of kAlign. A buffer that is
// not aligned goes through per-slot aligned bounce buffers; a tail shorter than kAlign, and the
// remainder of a short transfer, are done with plain pread/pwrite on `fd_buffered`. Nothing fails
// silently: an error, or an end of file inside the requested range, is recorded with the errno, the
// file and the operation, and reported by take_errors() after wait().
#include <fcntl.h>
#include <libaio.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t kAlign = 4096;  // O_DIRECT alignment: a page, >= every common logical block size

// errno, operation ("read"/"write"), path, file offset, byte count, detail
using ErrorRecord = std::tuple<int, std::string, std::string, int64_t, int64_t, std::string>;

struct Request {
    bool is_read = true;
    char* buf = nullptr;
    int64_t nbytes = 0;
    int64_t file_offset = 0;
    int fd_direct = -1;
    int fd_buffered = -1;
    std::string path;
    std::atomic<int> pending_shards{0};
    std::mutex mu;
    bool failed = false;
    ErrorRecord error;

    ~Request() {
        if (fd_direct >= 0) ::close(fd_direct);
        if (fd_buffered >= 0) ::close(fd_buffered);
    }

    // Record the first failure; later ones of the same request add nothing new.
    void fail(int err, int64_t at, int64_t len, const std::string& detail) {
        std::lock_guard<std::mutex> lock(mu);
        if (failed) return;
        failed = true;
        error = ErrorRecord{err, is_read ? "read" : "write", path, file_offset + at, len, detail};
    }
    bool has_failed() {
        std::lock_guard<std::mutex> lock(mu);
        return failed;
    }
};

struct Shard {
    std::shared_ptr<Request> req;
    int64_t begin;  // byte range relative to the request's start
    int64_t end;
};

class Handle;

class Worker {
   public:
    Worker(Handle* owner, int64_t block_size, int queue_depth, bool single_submit, bool overlap_events)
        : owner_(owner), block_(block_size), qd_(queue_depth), single_submit_(single_submit),
          overlap_(overlap_events) {
        std::memset(&ctx_, 0, sizeof(ctx_));
        int rc = io_setup(qd_, &ctx_);
        if (rc < 0) {
            throw std::runtime_error("io_setup(" + std::to_string(qd_) + ") failed: " + std::strerror(-rc) +
                                     " (the system-wide limit is /proc/sys/fs/aio-max-nr)");
        }
        void* mem = nullptr;
        if (posix_memalign(&mem, kAlign, static_cast<size_t>(block_) * qd_) != 0) {
            io_destroy(ctx_);
            throw std::runtime_error("cannot allocate " + std::to_string(block_ * qd_) + " bytes of bounce buffers");
        }
        bounce_ = static_cast<char*>(mem);
        thread_ = std::thread([this] { loop(); });
    }

    ~Worker() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        if (thread_.joinable()) thread_.join();
        io_destroy(ctx_);
        std::free(bounce_);
    }

    void enqueue(Shard shard) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            queue_.push_back(std::move(shard));
        }
        cv_.notify_one();
    }

   private:
    void loop();
    void run_shard(Shard& shard);
    void aio_range(Request& req, int64_t begin, int64_t end, bool direct);

    Handle* owner_;
    int64_t block_;
    int qd_;
    bool single_submit_;
    bool overlap_;
    io_context_t ctx_;
    char* bounce_ = nullptr;
    std::thread thread_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Shard> queue_;
    bool stop_ = false;
};

// Plain pread/pwrite of [begin, end) of the request (tails, remainders, unaligned requests).
void sync_range(Request& req, int64_t begin, int64_t end) {
    int64_t pos = begin;
    while (pos < end) {
        const size_t len = static_cast<size_t>(end - pos);
        const off_t off = static_cast<off_t>(req.file_offset + pos);
        ssize_t n = req.is_read ? ::pread(req.fd_buffered, req.buf + pos, len, off)
                                : ::pwrite(req.fd_buffered, req.buf + pos, len, off);
        if (n < 0) {
            if (errno == EINTR) continue;
            req.fail(errno, pos, end - pos, "");
            return;
        }
        if (n == 0) {
            if (req.is_read) {
                // report where the file really ends (fstat), not where this piece started: several
                // pieces of one request can hit the end, and the first to complete is recorded
                struct stat st;
                const int64_t eof = ::fstat(req.fd_buffered, &st) == 0 ? static_cast<int64_t>(st.st_size)
                                                                        : static_cast<int64_t>(off);
                req.fail(0, pos, end - pos, "short read: the file ends at byte " + std::to_string(eof) +
                                                ", inside the requested range");
            } else {
                req.fail(ENOSPC, pos, end - pos, "the write made no progress");
            }
            return;
        }
        pos += n;
    }
}

void Worker::aio_range(Request& req, int64_t begin, int64_t end, bool direct) {
    const int fd = direct ? req.fd_direct : req.fd_buffered;
    const bool bounce = direct && (reinterpret_cast<uintptr_t>(req.buf) % kAlign != 0);
    std::vector<struct iocb> cbs(qd_);
    std::vector<int64_t> slot_off(qd_), slot_len(qd_);
    std::vector<int> free_slots;
    for (int i = qd_ - 1; i >= 0; --i) free_slots.push_back(i);
    std::vector<struct iocb*> batch;
    std::vector<struct io_event> events(qd_);
    int64_t next = begin;
    int inflight = 0;
    while (true) {
        // overlap_events: refill a slot as soon as it completes; otherwise submit a full batch and
        // reap all of it before submitting the next one
        const bool may_fill = overlap_ || inflight == 0;
        batch.clear();
        while (may_fill && next < end && !free_slots.empty() && !req.has_failed()) {
            const int slot = free_slots.back();
            free_slots.pop_back();
            const int64_t len = std::min(block_, end - next);
            char* p = bounce ? bounce_ + static_cast<int64_t>(slot) * block_ : req.buf + next;
            if (bounce && !req.is_read) std::memcpy(p, req.buf + next, static_cast<size_t>(len));
            if (req.is_read) {
                io_prep_pread(&cbs[slot], fd, p, static_cast<size_t>(len), req.file_offset + next);
            } else {
                io_prep_pwrite(&cbs[slot], fd, p, static_cast<size_t>(len), req.file_offset + next);
            }
            cbs[slot].data = reinterpret_cast<void*>(static_cast<intptr_t>(slot));
            slot_off[slot] = next;
            slot_len[slot] = len;
            batch.push_back(&cbs[slot]);
            next += len;
        }
        size_t done = 0;
        while (done < batch.size()) {
            const long want = single_submit_ ? 1 : static_cast<long>(batch.size() - done);
            int rc = io_submit(ctx_, want, batch.data() + done);
            if (rc == -EAGAIN || rc == -EINTR) {
                if (inflight > 0) break;  // reap first, resubmit the rest below
                std::this_thread::yield();
                continue;
            }
            if (rc < 0) {
                const int slot = static_cast<int>(reinterpret_cast<intptr_t>(batch[done]->data));
                req.fail(-rc, slot_off[slot], slot_len[slot], "io_submit failed");
                break;
            }
            done += static_cast<size_t>(rc);
            inflight += rc;
        }
        // slots prepared but not submitted go back; their bytes are submitted again later
        for (size_t i = batch.size(); i > done; --i) {
            const int slot = static_cast<int>(reinterpret_cast<intptr_t>(batch[i - 1]->data));
            free_slots.push_back(slot);
            next = std::min(next, slot_off[slot]);
        }
        if (inflight == 0) {
            if (next >= end || req.has_failed()) return;
            continue;
        }
        const long min_nr = overlap_ ? 1 : inflight;
        int got = io_getevents(ctx_, min_nr, inflight, events.data(), nullptr);
        if (got == -EINTR) continue;
        if (got < 0) {
            // the context is unusable: nothing more can be reaped, so the buffers stay owned by the
            // kernel; report it (this is a kernel or resource failure, not a file error)
            req.fail(-got, begin, end - begin, "io_getevents failed");
            throw std::runtime_error(std::string("io_getevents failed: ") + std::strerror(-got));
        }
        for (int i = 0; i < got; ++i) {
            const int slot = static_cast<int>(reinterpret_cast<intptr_t>(events[i].data));
            const long res = static_cast<long>(events[i].res);
            --inflight;
            free_slots.push_back(slot);
            const int64_t off = slot_off[slot], len = slot_len[slot];
            if (res < 0) {
                req.fail(static_cast<int>(-res), off, len, "");
                continue;
            }
            if (bounce && req.is_read && res > 0) {
                std::memcpy(req.buf + off, bounce_ + static_cast<int64_t>(slot) * block_, static_cast<size_t>(res));
            }
            if (res < len) {
                // a short transfer (end of file, device full, signal): finish it synchronously so the
                // real cause (EOF, ENOSPC, EIO) is what gets reported
                sync_range(req, off + res, off + len);
            }
        }
    }
}

void Worker::run_shard(Shard& shard) {
    Request& req = *shard.req;
    const bool direct = req.fd_direct >= 0;
    // shards start on block boundaries and the request's file offset is aligned when direct, so
    // only the last shard can have a tail shorter than kAlign
    const int64_t aio_end = direct ? shard.begin + ((shard.end - shard.begin) / kAlign) * kAlign : shard.end;
    if (aio_end > shard.begin) aio_range(req, shard.begin, aio_end, direct);
    if (aio_end < shard.end && !req.has_failed()) sync_range(req, aio_end, shard.end);
}

class Handle {
   public:
    Handle(int64_t block_size, int queue_depth, bool single_submit, bool overlap_events, int threads)
        : block_(block_size), qd_(queue_depth), single_submit_(single_submit), overlap_(overlap_events),
          threads_(threads) {
        if (block_size <= 0 || block_size % kAlign != 0) {
            throw std::invalid_argument("block_size must be a positive multiple of " + std::to_string(kAlign) +
                                        ", got " + std::to_string(block_size));
        }
        if (queue_depth <= 0) throw std::invalid_argument("queue_depth must be >= 1");
        if (threads <= 0) throw std::invalid_argument("intra_op_parallelism must be >= 1");
        for (int i = 0; i < threads; ++i) {
            workers_.emplace_back(new Worker(this, block_, qd_, single_submit_, overlap_));
        }
    }

    ~Handle() {
        {
            py::gil_scoped_release release;
            wait_all();
            workers_.clear();
        }
    }

    // Queue one request; returns the number of requests in flight. Takes ownership of both fds.
    int submit(bool is_read, uintptr_t address, int64_t nbytes, int64_t file_offset, int fd_direct,
               int fd_buffered, const std::string& path) {
        auto req = std::make_shared<Request>();
        req->is_read = is_read;
        req->buf = reinterpret_cast<char*>(address);
        req->nbytes = nbytes;
        req->file_offset = file_offset;
        req->fd_direct = fd_direct;
        req->fd_buffered = fd_buffered;
        req->path = path;
        // shards of whole blocks, one per worker at most
        const int64_t blocks = (nbytes + block_ - 1) / block_;
        const int64_t per = std::max<int64_t>(1, (blocks + threads_ - 1) / threads_) * block_;
        std::vector<Shard> shards;
        for (int64_t b = 0; b < nbytes; b += per) shards.push_back(Shard{req, b, std::min(nbytes, b + per)});
        std::lock_guard<std::mutex> lock(mu_);
        ++inflight_;
        if (shards.empty()) {  // zero bytes: complete at once
            --inflight_;
            ++completed_;
            return inflight_;
        }
        req->pending_shards = static_cast<int>(shards.size());
        for (size_t i = 0; i < shards.size(); ++i) workers_[(next_worker_ + i) % workers_.size()]->enqueue(shards[i]);
        next_worker_ = (next_worker_ + shards.size()) % workers_.size();
        return inflight_;
    }

    void shard_done(const std::shared_ptr<Request>& req) {
        if (--req->pending_shards != 0) return;
        std::lock_guard<std::mutex> lock(mu_);
        if (req->has_failed()) errors_.push_back(req->error);
        --inflight_;
        ++completed_;
        cv_.notify_all();
    }

    // Block until every queued request finished; return how many completed since the last wait().
    int64_t wait() {
        py::gil_scoped_release release;
        return wait_all();
    }

    std::vector<ErrorRecord> take_errors() {
        std::lock_guard<std::mutex> lock(mu_);
        std::vector<ErrorRecord> out;
        out.swap(errors_);
        return out;
    }

    int inflight() {
        std::lock_guard<std::mutex> lock(mu_);
        return inflight_;
    }

    int64_t block_size() const { return block_; }
    int queue_depth() const { return qd_; }
    bool single_submit() const { return single_submit_; }
    bool overlap_events() const { return overlap_; }
    int threads() const { return threads_; }

   private:
    int64_t wait_all() {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return inflight_ == 0; });
        const int64_t n = completed_;
        completed_ = 0;
        return n;
    }

    int64_t block_;
    int qd_;
    bool single_submit_;
    bool overlap_;
    int threads_;
    std::vector<std::unique_ptr<Worker>> workers_;
    size_t next_worker_ = 0;
    std::mutex mu_;
    std::condition_variable cv_;
    int inflight_ = 0;
    int64_t completed_ = 0;
    std::vector<ErrorRecord> errors_;
};

void Worker::loop() {
    while (true) {
        Shard shard;
        {
            std::unique_lock<std::mutex> lock(mu_);
            cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
            if (queue_.empty()) return;  // stop requested and nothing left
            shard = std::move(queue_.front());
            queue_.pop_front();
        }
        try {
            run_shard(shard);
        } catch (const std::exception& exc) {
            shard.req->fail(EIO, shard.begin, shard.end - shard.begin, exc.what());
        }
        owner_->shard_done(shard.req);
    }
}

// Allocate [offset, offset + len) of a file about to be written when the write would extend it.
// Extending O_DIRECT writes are serialised by file systems such as ext4 (each waits for all direct
// I/O in flight on the inode), which defeats queue_depth; writes inside the allocated size are not
// (the Python side calls this only when more than one request can be in flight: with one, the
// unwritten-extent conversion of each write costs more than it saves).
// Returns 0 or an errno (ENOSPC here is the early, clear form of a full device).
int preallocate(int fd, int64_t offset, int64_t len) {
    struct stat st;
    if (::fstat(fd, &st) != 0) return errno;
    if (!S_ISREG(st.st_mode)) return 0;  // a block device has its size already
    if (offset + len <= static_cast<int64_t>(st.st_size) || len <= 0) return 0;
    if (::fallocate(fd, 0, static_cast<off_t>(offset), static_cast<off_t>(len)) == 0) return 0;
    const int err = errno;
    if (err == EOPNOTSUPP || err == ENOSYS || err == EINTR) return 0;  // the writes extend the file instead
    return err;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "dscore async_io: host-memory file I/O through Linux kernel AIO (libaio), O_DIRECT when aligned";
    m.attr("alignment") = kAlign;
    m.def("preallocate", &preallocate, py::arg("fd"), py::arg("offset"), py::arg("nbytes"),
          py::call_guard<py::gil_scoped_release>(),
          "Allocate a range a write would extend the file into (fallocate); returns 0 or an errno.");
    py::class_<Handle>(m, "Handle")
        .def(py::init<int64_t, int, bool, bool, int>(), py::arg("block_size"), py::arg("queue_depth"),
             py::arg("single_submit"), py::arg("overlap_events"), py::arg("threads"))
        .def("submit", &Handle::submit, py::arg("is_read"), py::arg("address"), py::arg("nbytes"),
             py::arg("file_offset"), py::arg("fd_direct"), py::arg("fd_buffered"), py::arg("path"),
             "Queue a read/write of nbytes at address to file_offset; takes ownership of both fds.")
        .def("wait", &Handle::wait, "Block until all requests finished; return the count completed since the last wait.")
        .def("take_errors", &Handle::take_errors,
             "Failures since the last call: (errno, op, path, file_offset, nbytes, detail) tuples.")
        .def("inflight", &Handle::inflight)
        .def_property_readonly("block_size", &Handle::block_size)
        .def_property_readonly("queue_depth", &Handle::queue_depth)
        .def_property_readonly("single_submit", &Handle::single_submit)
        .def_property_readonly("overlap_events", &Handle::overlap_events)
        .def_property_readonly("threads", &Handle::threads);
}
