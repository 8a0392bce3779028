// epx: expert-parallel exchange for Mixture-of-Experts. Include this one header.
#pragma once
#include "epx/all_ranks.hpp"
#include "epx/buffer.hpp"
#include "epx/codec.hpp"
#include "epx/config.hpp"
#include "epx/dtype.hpp"
#include "epx/error.hpp"
#include "epx/group.hpp"
#include "epx/low_latency.hpp"
#include "epx/ops.hpp"
#include "epx/tensor.hpp"
