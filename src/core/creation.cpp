#include "core/creation.hpp"

#include <vector>

#include "core/backend.hpp"
#include "core/check.hpp"
#include "core/timeout.hpp"

namespace epx::detail {

namespace {

// A record is the error, a NUL, then the config: the error's words never hold a NUL.
std::string record_of(const std::string& config, const std::string& error) { return error + '\0' + config; }
std::string error_of(const std::string& record) { return record.substr(0, record.find('\0')); }
std::string config_of(const std::string& record) {
  const size_t at = record.find('\0');
  return at == std::string::npos ? "" : record.substr(at + 1);
}

}  // namespace

// An invalid timeout in the config is one of the errors agreed on, so the agreement itself
// waits the default time.
std::chrono::milliseconds creation_timeout(int64_t timeout_ms) {
  try {
    return resolve_timeout(timeout_ms > 0 ? timeout_ms : 0);
  } catch (const Error&) {
    return std::chrono::milliseconds(60000);
  }
}

void agree_on_creation(const Group& group, const char* what, const std::string& config, const std::string& error,
                       int64_t timeout_ms, ErrorCode code) {
  require(group.state() != nullptr, what, ": the group is empty");
  const int rank = group.rank();
  const std::string step = cat(what, " creation (config exchange)");
  const std::vector<std::string> records =
      group.state()->all_gather(rank, record_of(config, error), creation_timeout(timeout_ms), step);
  if (!error.empty()) throw Error(code, error);
  for (size_t r = 0; r < records.size(); ++r)
    if (!error_of(records[r]).empty())
      fail(ErrorCode::peer_failed, what, " creation (rank ", rank, "): rank ", r,
           " refused its config, so the group stops: ", error_of(records[r]));
  for (size_t r = 0; r < records.size(); ++r)
    if (config_of(records[r]) != config)
      fail(ErrorCode::config_mismatch, what, " creation (rank ", rank, "): ranks disagree on the ", what,
           " config: rank ", rank, " has {", config, "} but rank ", r, " has {", config_of(records[r]),
           "}; every rank must create its ", what, " with the same config");
}

}  // namespace epx::detail

namespace epx {

std::vector<std::string> Group::all_gather(const std::string& record, int64_t timeout_ms) const {
  detail::require(state_ != nullptr, "group all_gather: the group is empty");
  // Each rank's record goes with a mark: 'r' and the record, or 'e' and why this rank refused it.
  const bool too_long = record.size() > kMaxRecordBytes;
  const std::string why = detail::cat("group all_gather: a record holds at most ", kMaxRecordBytes, " bytes, rank ",
                                      rank_, "'s has ", record.size());
  const std::vector<std::string> marked = state_->all_gather(
      rank_, too_long ? "e" + why : "r" + record, detail::creation_timeout(timeout_ms), "group all_gather");
  if (too_long) throw Error(ErrorCode::invalid_argument, why);
  std::vector<std::string> records;
  for (size_t r = 0; r < marked.size(); ++r) {
    if (marked[r].empty() || marked[r][0] != 'r')
      detail::fail(ErrorCode::peer_failed, "group all_gather (rank ", rank_, "): rank ", r, " failed: ",
                   marked[r].empty() ? "" : marked[r].substr(1));
    records.push_back(marked[r].substr(1));
  }
  return records;
}

}  // namespace epx
