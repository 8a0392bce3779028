// Buffer: the communication state of one MoE layer shape on one rank. Creating it is
// collective: every rank of the group constructs one, with the same config, in the same order.
#pragma once
#include <memory>

#include "epx/config.hpp"
#include "epx/group.hpp"
#include "epx/ops.hpp"

namespace epx {

namespace detail {
class Backend;
}

class Buffer {
 public:
  Buffer(const Group& group, const BufferConfig& config);
  ~Buffer();
  Buffer(Buffer&&) noexcept;
  Buffer& operator=(Buffer&&) noexcept;

  const BufferConfig& config() const;
  const Group& group() const;

  // All four are collective: every rank calls them in the same order.
  DispatchResult dispatch(const DispatchInput& in, const DispatchOptions& opt = {});
  CombineResult combine(const CombineInput& in, const Handle& handle, const CombineOptions& opt = {});
  DispatchBackwardResult dispatch_backward(const DispatchBackwardInput& in, const Handle& handle);
  CombineBackwardResult combine_backward(const CombineBackwardInput& in, const Handle& handle,
                                         const CombineOptions& opt = {});

 private:
  std::unique_ptr<detail::Backend> backend_;
};

}  // namespace epx
