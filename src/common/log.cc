#include "common/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

namespace pd::log {

void init(std::string_view level) {
  auto logger = spdlog::stderr_color_mt("pdserve");
  spdlog::set_default_logger(logger);
  spdlog::set_pattern("%Y-%m-%d %H:%M:%S.%e %^%l%$ [%t] %v");
  spdlog::set_level(spdlog::level::from_str(std::string(level)));
}

}  // namespace pd::log
