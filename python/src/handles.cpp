#include "handles.hpp"

#include <atomic>
#include <mutex>
#include <string>
#include <unordered_map>

#include "tensor_io.hpp"

namespace epx::python {

namespace {

// Live tokens by id. Weak: a token lives exactly as long as torch holds its tensor.
struct Registry {
  std::mutex mutex;
  std::unordered_map<int64_t, std::weak_ptr<TokenBox>> boxes;
  std::atomic<int64_t> next_id{1};
};

Registry& registry() {
  static auto* r = new Registry;  // never destroyed: tokens may die after static destructors ran
  return *r;
}

py::object export_box(const std::shared_ptr<TokenBox>& box) {
  Registry& r = registry();
  box->words[0] = r.next_id.fetch_add(1);
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    r.boxes[box->words[0]] = box;
  }
  const TensorView view = TensorView::of(box->words, DType::i64, {4});
  return export_tensor(Tensor(std::shared_ptr<void>(box, box->words), view));
}

}  // namespace

TokenBox::~TokenBox() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.boxes.erase(words[0]);
}

py::object export_token(const Handle& h, int64_t num_rows, bool overflow, int64_t dropped_slots) {
  auto box = std::make_shared<TokenBox>();
  box->handle = h;
  box->words[1] = num_rows;
  box->words[2] = overflow ? 1 : 0;
  box->words[3] = dropped_slots;
  return export_box(box);
}

py::object export_token(const LowLatencyHandle& h, int64_t tokens) {
  auto box = std::make_shared<TokenBox>();
  box->ll_handle = h;
  box->words[1] = tokens;
  return export_box(box);
}

std::shared_ptr<TokenBox> resolve_token(py::handle arg, const char* what) {
  const TensorView v = input_view(arg, what);
  if (!v.defined()) throw BindingError(std::string(what) + ": missing; pass the handle its dispatch returned");
  if (v.device != DeviceKind::host || v.dtype != DType::i64 || v.numel() != 4)
    throw BindingError(std::string(what) + ": not a handle token (expected the [4] int64 host tensor a dispatch returned)");
  const int64_t id = *v.ptr<const int64_t>();
  Registry& r = registry();
  std::shared_ptr<TokenBox> box;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.boxes.find(id);
    if (it != r.boxes.end()) box = it->second.lock();
  }
  if (!box) throw BindingError(std::string(what) + ": its handle is gone (every copy of the dispatch's handle was released)");
  return box;
}

}  // namespace epx::python
