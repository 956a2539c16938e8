// dscore shm_sync: the memory ordering and futex signalling of the same-host shared-memory transport.
//
// The words live in memfd segments mapped by several processes; every function takes the address of a
// naturally aligned 64-bit word (Python passes data_ptr() + offset). Lock-free std::atomic operations are
// address-free, so they order accesses between processes exactly as between threads.
//
// Publishing (writer, in its own segment):   payload bytes (any stores, also non-temporal ones)
//                                             -> descriptor words (relaxed)
//                                             -> full fence (orders the payload's non-temporal stores too:
//                                                mfence on x86-64, dmb ish on AArch64)
//                                             -> release store of the descriptor's number word
//                                             -> release store of the posted word, FUTEX_WAKE on it.
// Reading (peer):  acquire load of the posted word / the descriptor's number; everything stored before the
//                  matching release store (descriptor and payload) is then visible.
// Acknowledgement: the reader's release store of the exchange number into its own segment after it read the
//                  payload; the writer's acquire load of it before reusing the region (so the reader's loads
//                  of the payload happen before the writer's new stores into it).
//
// futex_wait / futex_wake act on the low 32 bits of a 64-bit word (the half FUTEX_WAIT compares), as
// shared (not FUTEX_PRIVATE) futexes since the word is in memory of several processes. Return codes are
// checked: only "woken", "value changed" (EAGAIN), "timed out" and "interrupted" are normal outcomes.
#include <linux/futex.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

static_assert(std::atomic<int64_t>::is_always_lock_free, "64-bit atomics must be lock-free (address-free)");
static_assert(sizeof(std::atomic<int64_t>) == sizeof(int64_t), "an atomic word must be a plain word");

std::atomic<int64_t>* word(uintptr_t addr) {
    if (addr == 0 || addr % alignof(std::atomic<int64_t>) != 0) {
        throw std::invalid_argument("shm_sync: address " + std::to_string(addr) + " is not an aligned 64-bit word");
    }
    return reinterpret_cast<std::atomic<int64_t>*>(addr);
}

uint32_t* futex_half(uintptr_t addr) {
    word(addr);  // validates alignment
    auto* half = reinterpret_cast<uint32_t*>(addr);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    half += 1;
#endif
    return half;
}

int64_t load_acquire(uintptr_t addr) { return word(addr)->load(std::memory_order_acquire); }

void store_release(uintptr_t addr, int64_t value) {
    std::atomic_thread_fence(std::memory_order_seq_cst);  // earlier non-temporal stores drain first
    word(addr)->store(value, std::memory_order_release);
}

// Writes desc[1:] (relaxed), then desc[0] = number with a release store after a full fence.
void publish_descriptor(uintptr_t addr, int64_t number, const std::vector<int64_t>& rest) {
    auto* base = word(addr);
    for (size_t i = 0; i < rest.size(); ++i) base[i + 1].store(rest[i], std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    base[0].store(number, std::memory_order_release);
}

// The descriptor at addr if its number word (acquire) equals `number`; otherwise an empty list.
std::vector<int64_t> read_descriptor(uintptr_t addr, int64_t number, int64_t words) {
    auto* base = word(addr);
    std::vector<int64_t> out;
    if (base[0].load(std::memory_order_acquire) != number) return out;
    out.reserve(static_cast<size_t>(words));
    out.push_back(number);
    for (int64_t i = 1; i < words; ++i) out.push_back(base[i].load(std::memory_order_relaxed));
    return out;
}

// 0: woken (or spuriously returned); 1: the word no longer held `expected` (EAGAIN); 2: timed out;
// 3: interrupted by a signal. Any other failure raises OSError with the errno's text.
int futex_wait(uintptr_t addr, int64_t expected, double timeout_s) {
    uint32_t* half = futex_half(addr);
    struct timespec ts;
    struct timespec* tsp = nullptr;
    if (timeout_s >= 0) {
        ts.tv_sec = static_cast<time_t>(timeout_s);
        ts.tv_nsec = static_cast<long>((timeout_s - static_cast<double>(ts.tv_sec)) * 1e9);
        tsp = &ts;
    }
    const uint32_t want = static_cast<uint32_t>(static_cast<uint64_t>(expected) & 0xFFFFFFFFu);
    long rc;
    int err;
    {
        py::gil_scoped_release nogil;
        rc = syscall(SYS_futex, half, FUTEX_WAIT, want, tsp, nullptr, 0);
        err = errno;
    }
    if (rc == 0) return 0;
    switch (err) {
        case EAGAIN: return 1;
        case ETIMEDOUT: return 2;
        case EINTR: return 3;
        default:
            throw std::runtime_error(std::string("shm_sync: FUTEX_WAIT failed: ") + std::strerror(err));
    }
}

// Wakes up to `count` waiters on the word; returns how many were woken. Failures raise.
int64_t futex_wake(uintptr_t addr, int64_t count) {
    uint32_t* half = futex_half(addr);
    long rc = syscall(SYS_futex, half, FUTEX_WAKE, static_cast<int>(count), nullptr, nullptr, 0);
    if (rc < 0) {
        int err = errno;
        throw std::runtime_error(std::string("shm_sync: FUTEX_WAKE failed: ") + std::strerror(err));
    }
    return rc;
}

// Release store of `value` into the word, then FUTEX_WAKE of every waiter on it.
int64_t store_release_and_wake(uintptr_t addr, int64_t value) {
    store_release(addr, value);
    return futex_wake(addr, 1 << 30);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "release/acquire words and futex wait/wake for dscore's shared-memory transport";
    m.def("load_acquire", &load_acquire, py::arg("addr"));
    m.def("store_release", &store_release, py::arg("addr"), py::arg("value"));
    m.def("publish_descriptor", &publish_descriptor, py::arg("addr"), py::arg("number"), py::arg("rest"));
    m.def("read_descriptor", &read_descriptor, py::arg("addr"), py::arg("number"), py::arg("words"));
    m.def("futex_wait", &futex_wait, py::arg("addr"), py::arg("expected"), py::arg("timeout_s"));
    m.def("futex_wake", &futex_wake, py::arg("addr"), py::arg("count"));
    m.def("store_release_and_wake", &store_release_and_wake, py::arg("addr"), py::arg("value"));
}
