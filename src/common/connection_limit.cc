#include "common/connection_limit.h"

#include <sys/resource.h>

#include <cerrno>
#include <cstring>

#include "common/log.h"

namespace pd {

Result<ConnectionLimitPlan> plan_connection_limit(std::string_view flag, int64_t requested, bool requested_explicitly,
                                                  const ConnectionFdBudget& budget, const OpenFileLimits& limits) {
  if (requested < 1 || requested > kMaxConnectionsCeiling)
    return invalid_argument("{} must be 1..{}, got {}", flag, kMaxConnectionsCeiling, requested);
  const uint64_t per_connection = static_cast<uint64_t>(budget.fds_per_connection);
  const uint64_t reserved = static_cast<uint64_t>(budget.reserved_fds);
  const uint64_t needed = static_cast<uint64_t>(requested) * per_connection + reserved;
  if (needed <= limits.soft) return ConnectionLimitPlan{requested, limits.soft, {}};
  // Short: raise the soft limit as far as the hard limit goes rather than to exactly what the cap
  // needs, so files the budget does not count (idle pooled connections, a transport's extra
  // sockets) find room too.
  const uint64_t raised = limits.hard == OpenFileLimits::kUnlimited ? needed : limits.hard;
  if (needed <= raised) return ConnectionLimitPlan{requested, raised, {}};

  const auto why = fmt::format("{} per connection + {} reserved file descriptors; the RLIMIT_NOFILE hard limit is {}",
                               per_connection, reserved, limits.hard);
  if (requested_explicitly) {
    return resource_exhausted("{} {} needs {} file descriptors ({}): lower {} or raise the limit (ulimit -n)", flag,
                              requested, needed, why, flag);
  }
  const int64_t fitting = raised > reserved ? static_cast<int64_t>((raised - reserved) / per_connection) : 0;
  if (fitting < 1) return resource_exhausted("no connection fits the open-file limit ({})", why);
  return ConnectionLimitPlan{fitting, raised,
                             fmt::format("{} lowered from its default {} to {} ({})", flag, requested, fitting, why)};
}

Result<int64_t> fit_connection_limit_to_open_files(std::string_view flag, int64_t requested, bool requested_explicitly,
                                                   const ConnectionFdBudget& budget) {
  rlimit current{};
  if (getrlimit(RLIMIT_NOFILE, &current) != 0)
    return internal_error("getrlimit(RLIMIT_NOFILE) failed: {}", std::strerror(errno));
  auto as_limit = [](rlim_t value) { return value == RLIM_INFINITY ? OpenFileLimits::kUnlimited : value; };
  const OpenFileLimits limits{as_limit(current.rlim_cur), as_limit(current.rlim_max)};
  auto plan = plan_connection_limit(flag, requested, requested_explicitly, budget, limits);
  if (!plan.ok()) return plan.status();
  if (plan->soft_limit != limits.soft) {
    rlimit raised = current;
    raised.rlim_cur = static_cast<rlim_t>(plan->soft_limit);
    if (setrlimit(RLIMIT_NOFILE, &raised) != 0) {
      return resource_exhausted("{} {} needs the RLIMIT_NOFILE soft limit raised from {} to {}, which failed: {}", flag,
                                plan->max_connections, limits.soft, plan->soft_limit, std::strerror(errno));
    }
    PD_LOG_INFO("raised the RLIMIT_NOFILE soft limit from {} to {} for {} {}", limits.soft, plan->soft_limit, flag,
                plan->max_connections);
  }
  if (!plan->lowered_note.empty()) PD_LOG_WARN("{}", plan->lowered_note);
  return plan->max_connections;
}

}  // namespace pd
