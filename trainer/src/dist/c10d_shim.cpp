// A C ABI over PyTorch's c10d (TCPStore, ProcessGroupGloo, ProcessGroupNCCL) for llora's Rust
// side (trainer/src/dist/c10d.rs). Built by trainer/build.rs with the `cc` crate against the
// venv's libtorch, as tch builds its own wrapper.
//
// Every entry point catches C++ exceptions and returns them as a message (c10d throws when a
// peer's connection closes or an operation times out), so a failing collective is a Rust
// error, never an abort. Messages are malloc'd; the caller frees them with llora_c10d_free.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "shim.h"  // model/src/shim.h: the error guard every llora shim shares

#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#ifdef LLORA_WITH_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace {

struct Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
  std::chrono::milliseconds timeout;
};

using llora_shim::guarded;

// Sets `key` of `store` to `len` bytes.
int set_bytes(c10d::Store& store, const char* key, const uint8_t* data, size_t len, char** err) {
  return guarded(err, [&] { store.set(std::string(key), std::vector<uint8_t>(data, data + len)); });
}

// The bytes of `key` in `store` (waits up to its timeout), malloc'd for the caller.
int get_bytes(c10d::Store& store, const char* key, uint8_t** data, size_t* len, char** err) {
  return guarded(err, [&] {
    auto v = store.get(std::string(key));
    *data = static_cast<uint8_t*>(std::malloc(v.size() + 1));
    if (!v.empty()) std::memcpy(*data, v.data(), v.size());
    *len = v.size();
  });
}

// The job's store, shared by the groups made on it.
struct StoreBox {
  c10::intrusive_ptr<c10d::TCPStore> tcp;
};

void wait(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout) {
  // wait() rethrows the collective's failure; a false return means the timeout passed.
  if (!work->wait(timeout)) throw std::runtime_error("collective timed out");
}

}  // namespace

extern "C" {

// A connection to the job's TCPStore (served by this process when `is_server`: rank 0 without
// torchrun's agent store), before any group: the ranks' start-up rendezvous runs on it, then
// the world's group. Connecting waits up to `connect_ms` for the server; operations then wait
// up to `timeout_ms`.
void* llora_c10d_store_new(const char* host, uint16_t port, int is_server, int64_t connect_ms, int64_t timeout_ms,
                           char** err) {
  StoreBox* box = nullptr;
  guarded(err, [&] {
    c10d::TCPStoreOptions opts;
    opts.port = port;
    opts.isServer = is_server != 0;
    opts.numWorkers = std::nullopt;  // torchrun's agent store has its own; do not wait here.
    opts.waitWorkers = false;
    opts.timeout = std::chrono::milliseconds(connect_ms);
    auto tcp = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    tcp->setTimeout(std::chrono::milliseconds(timeout_ms));
    box = new StoreBox{tcp};
  });
  return box;
}

void llora_c10d_store_free(void* s) { delete static_cast<StoreBox*>(s); }

// Whether `key` (a full key, no prefix) is set, without waiting.
int llora_c10d_store_check(void* s, const char* key, int* exists, char** err) {
  auto* box = static_cast<StoreBox*>(s);
  return guarded(err, [&] { *exists = box->tcp->check({std::string(key)}) ? 1 : 0; });
}

// Sets `key` (a full key) to `len` bytes.
int llora_c10d_store_put(void* s, const char* key, const uint8_t* data, size_t len, char** err) {
  return set_bytes(*static_cast<StoreBox*>(s)->tcp, key, data, len, err);
}

// The bytes of `key` (a full key; waits up to the store's timeout), malloc'd for the caller.
int llora_c10d_store_fetch(void* s, const char* key, uint8_t** data, size_t* len, char** err) {
  return get_bytes(*static_cast<StoreBox*>(s)->tcp, key, data, len, err);
}

// The backend of a new group on `s`'s store: 0 = Gloo (CPU tensors), 1 = NCCL (CUDA tensors).
// `prefix`: every key of the group lives under it (llora's, per launcher attempt).
// `cuda_device`: for NCCL, this rank's GPU (LOCAL_RANK): made the current device and bound to
// the group, as torch.distributed.init_process_group(device_id=...) does, so that no rank opens
// a context or a communicator on GPU 0.
void* llora_c10d_new(void* s, const char* prefix, int rank, int world, int backend, int cuda_device,
                     int64_t timeout_ms, char** err) {
  Group* group = nullptr;
  guarded(err, [&] {
    auto timeout = std::chrono::milliseconds(timeout_ms);
    auto tcp = static_cast<StoreBox*>(s)->tcp;
    // A prefix keeps llora's keys apart from torchrun's rendezvous keys in the agent store,
    // and one attempt's keys (Gloo's peer addresses) from a restarted attempt's.
    auto store = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), tcp);
    c10::intrusive_ptr<c10d::Backend> pg;
    if (backend == 0) {
      auto o = c10d::ProcessGroupGloo::Options::create(timeout);
      // As torch.distributed does: GLOO_SOCKET_IFNAME picks the interface (multi-node hosts
      // whose hostname resolves to the wrong one); else the hostname's address or loopback.
      const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
      o->devices.push_back(ifname != nullptr && *ifname != '\0'
                               ? c10d::ProcessGroupGloo::createDeviceForInterface(std::string(ifname))
                               : c10d::ProcessGroupGloo::createDefaultDevice());
      pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, o);
    } else {
#ifdef LLORA_WITH_NCCL
      auto device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(cuda_device));
      c10::cuda::set_device(device.index());
      auto o = c10d::ProcessGroupNCCL::Options::create();
      o->timeout = timeout;
      pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world, o);
      pg->setBoundDeviceId(device);
#else
      throw std::runtime_error("this llora was built without NCCL (no CUDA headers at build time)");
#endif
    }
    group = new Group{store, pg, timeout};
  });
  return group;
}

// Ends the group as torch.distributed.destroy_process_group does on success: NCCL finalises and
// destroys its communicators and joins its watchdog while the CUDA runtime is still up. A
// ProcessGroupNCCL destroyed without this aborts in its destructor, which after main returns
// meets "CUDA error: driver shutting down" and SIGABRT (the first GPU run). Gloo holds no
// device state: nothing to do.
int llora_c10d_shutdown(void* g, char** err) {
  auto* group = static_cast<Group*>(g);
  return guarded(err, [&] {
#ifdef LLORA_WITH_NCCL
    if (auto* nccl = dynamic_cast<c10d::ProcessGroupNCCL*>(group->backend.get())) nccl->shutdown();
#endif
  });
}

// Ends the group on an error path (a peer may be dead, so nothing waits for it): NCCL aborts its
// communicators now, while the CUDA runtime is up, rather than in a destructor at exit.
void llora_c10d_abort(void* g) {
  auto* group = static_cast<Group*>(g);
  try {
    group->backend->abort();
  } catch (...) {
  }
}

// The group's current device: what the NCCL half bound (-1 for Gloo, or without NCCL).
int llora_c10d_bound_device(void* g) {
  auto* group = static_cast<Group*>(g);
  auto d = group->backend->getBoundDeviceId();
  return d.has_value() ? static_cast<int>(d->index()) : -1;
}

void llora_c10d_free_group(void* g) { delete static_cast<Group*>(g); }

void llora_c10d_free(char* s) { std::free(s); }

// In-place all-reduce of one tensor; op 0 = sum, 1 = max.
int llora_c10d_all_reduce(void* g, at::Tensor* t, int op, char** err) {
  auto* group = static_cast<Group*>(g);
  return guarded(err, [&] {
    std::vector<at::Tensor> ts{*t};
    c10d::AllreduceOptions o;
    o.reduceOp = op == 1 ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
    o.timeout = group->timeout;
    wait(group->backend->allreduce(ts, o), group->timeout);
  });
}

// In-place broadcast of one tensor from `root`.
int llora_c10d_broadcast(void* g, at::Tensor* t, int root, char** err) {
  auto* group = static_cast<Group*>(g);
  return guarded(err, [&] {
    std::vector<at::Tensor> ts{*t};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.timeout = group->timeout;
    wait(group->backend->broadcast(ts, o), group->timeout);
  });
}

// An all-gather in flight: c10d's work and the tensors it writes and reads, kept alive until
// the caller has waited on it (llora_c10d_work_wait) and freed it (llora_c10d_work_free).
struct Pending {
  c10::intrusive_ptr<c10d::Work> work;
  std::chrono::milliseconds timeout;
  std::vector<std::vector<at::Tensor>> outputs;
  std::vector<at::Tensor> inputs;
};

// Starts gathering `in` of every rank into `out`, whose first dimension is world × in's, and
// returns at once (Gloo runs it on its worker threads, NCCL on its stream); null on failure.
void* llora_c10d_all_gather_start(void* g, at::Tensor* out, at::Tensor* in, int world, char** err) {
  auto* group = static_cast<Group*>(g);
  Pending* pending = nullptr;
  guarded(err, [&] {
    auto p = std::make_unique<Pending>();
    p->outputs = {out->chunk(world, 0)};
    p->inputs = {*in};
    p->timeout = group->timeout;
    c10d::AllgatherOptions o;
    o.timeout = group->timeout;
    p->work = group->backend->allgather(p->outputs, p->inputs, o);
    pending = p.release();
  });
  return pending;
}

// Starts the in-place all-reduce (sum) of `t` and returns at once, as llora_c10d_all_gather_start
// does: the gradient buckets reduced while backward goes on; null on failure.
void* llora_c10d_all_reduce_start(void* g, at::Tensor* t, char** err) {
  auto* group = static_cast<Group*>(g);
  Pending* pending = nullptr;
  guarded(err, [&] {
    auto p = std::make_unique<Pending>();
    p->inputs = {*t};
    p->timeout = group->timeout;
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    o.timeout = group->timeout;
    p->work = group->backend->allreduce(p->inputs, o);
    pending = p.release();
  });
  return pending;
}

// Waits for a started collective (on NCCL: makes the current stream wait for it).
int llora_c10d_work_wait(void* w, char** err) {
  auto* p = static_cast<Pending*>(w);
  return guarded(err, [&] { wait(p->work, p->timeout); });
}

// Frees a collective's handle; it must have been waited on.
void llora_c10d_work_free(void* w) { delete static_cast<Pending*>(w); }

int llora_c10d_barrier(void* g, char** err) {
  auto* group = static_cast<Group*>(g);
  return guarded(err, [&] {
    c10d::BarrierOptions o;
    o.timeout = group->timeout;
    wait(group->backend->barrier(o), group->timeout);
  });
}

// Store: set a key (bytes), get one (waits up to the group's timeout), add to a counter.
int llora_c10d_store_set(void* g, const char* key, const uint8_t* data, size_t len, char** err) {
  return set_bytes(*static_cast<Group*>(g)->store, key, data, len, err);
}

int llora_c10d_store_get(void* g, const char* key, uint8_t** data, size_t* len, char** err) {
  return get_bytes(*static_cast<Group*>(g)->store, key, data, len, err);
}

// Sets c10's log threshold (0 info, 1 warning, 2 error, 3 fatal) and returns the one it replaces. Raised
// to errors where each failed store read or connection attempt would be logged as a warning
// carrying its C++ stack (~25 lines before llora's one-line error): after a collective failed
// (the peers' heartbeats are probed on a store that may be dead) and while the start-up
// rendezvous waits for the store's server.
int llora_c10d_log_level(int level) {
  int old = FLAGS_caffe2_log_level;
  FLAGS_caffe2_log_level = level;
  return old;
}

int llora_c10d_store_add(void* g, const char* key, int64_t delta, int64_t* value, char** err) {
  auto* group = static_cast<Group*>(g);
  return guarded(err, [&] { *value = group->store->add(std::string(key), delta); });
}

}  // extern "C"
