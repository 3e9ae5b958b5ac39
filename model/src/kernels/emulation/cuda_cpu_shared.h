// Checked __shared__ memory for the tests' build of our kernels on the CPU (cuda_cpu.h): the
// build rewrites each `__shared__ T name[A][B];` of a kernel source into
// `static ::llora_emu::Shared<T, A, B> name;` (model/build.rs), whose every access checks its
// index against the declared size and the element's last accesses against the block's
// barriers: a write and another thread's access of one element with no __syncthreads between
// is a race, as on a GPU. A failure is recorded for the launch (`fail`) and the access goes to a
// scratch element, so the launch ends and reports it. Accesses are serialised by one lock (the
// tests' problems are small); ThreadSanitizer's build keeps plain statics instead, so that it
// sees the kernels' own accesses.
#pragma once

#include <cstdio>
#include <mutex>
#include <string>
#include <type_traits>

namespace llora_emu {

// The current barrier epoch of the running block: it grows at each completed __syncthreads and
// at each block's start (emulate.cpp), never going back, so stale records never match.
unsigned long long epoch();
std::mutex& shared_lock();

// No thread / several threads, in an element's record.
constexpr int kNobody = -1;
constexpr int kMany = -2;

// One element of a shared array, with who last wrote and read it, and in which epoch.
template <typename T>
class Shared {
  public:
    Shared() = default;
    Shared(const Shared&) = delete;
    Shared& operator=(const Shared&) = delete;

    operator T() {
        std::lock_guard<std::mutex> hold(shared_lock());
        unsigned long long now = epoch();
        int me = static_cast<int>(current.linear);
        if (writer_ != kNobody && writer_ != me && written_ == now) {
            report("read", writer_);
        }
        if (read_ != now) {
            read_ = now;
            reader_ = me;
        } else if (reader_ != me) {
            reader_ = kMany;
        }
        return value_;
    }

    Shared& operator=(T value) {
        std::lock_guard<std::mutex> hold(shared_lock());
        unsigned long long now = epoch();
        int me = static_cast<int>(current.linear);
        if (writer_ != kNobody && writer_ != me && written_ == now) {
            report("write", writer_);
        } else if (read_ == now && reader_ != me) {
            report("write", reader_);
        }
        writer_ = me;
        written_ = now;
        value_ = value;
        return *this;
    }

  private:
    void report(const char* access, int other) {
        char what[200];
        std::snprintf(what, sizeof what,
                      "a race on __shared__ memory: thread %u's %s of an element thread %s touched with no "
                      "__syncthreads between",
                      current.linear, access, other == kMany ? "(several)" : std::to_string(other).c_str());
        fail(what);
    }

    T value_{};
    int writer_ = kNobody, reader_ = kNobody;
    unsigned long long written_ = 0, read_ = 0;
};

template <typename T, long N, long... Rest>
class SharedArray;

// What indexing an array of these dimensions gives: an element, or an array of one fewer.
template <typename T, long... Dims>
struct ItemOf {
    using type = Shared<T>;
};
template <typename T, long N, long... Rest>
struct ItemOf<T, N, Rest...> {
    using type = SharedArray<T, N, Rest...>;
};

// An array of N (then Rest...) elements whose index is checked.
template <typename T, long N, long... Rest>
class SharedArray {
    using Item = typename ItemOf<T, Rest...>::type;

  public:
    Item& operator[](long i) {
        if (i < 0 || i >= N) {
            char what[160];
            std::snprintf(what, sizeof what, "__shared__ index %ld past an array of %ld (thread %u, block %u)", i, N,
                          current.linear, current.block.x);
            fail(what);
            static Item scratch;
            return scratch;
        }
        return items_[i];
    }

  private:
    Item items_[N];
};

}  // namespace llora_emu
