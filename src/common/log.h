// Logging: spdlog underneath; one call sets the level and format for the process.
#pragma once

#include <spdlog/spdlog.h>

#include <string_view>

namespace pd::log {

// level: trace|debug|info|warn|error|off. Unknown levels fall back to info.
void init(std::string_view level = "info");

}  // namespace pd::log

#define PD_LOG_TRACE(...) SPDLOG_TRACE(__VA_ARGS__)
#define PD_LOG_DEBUG(...) ::spdlog::debug(__VA_ARGS__)
#define PD_LOG_INFO(...) ::spdlog::info(__VA_ARGS__)
#define PD_LOG_WARN(...) ::spdlog::warn(__VA_ARGS__)
#define PD_LOG_ERROR(...) ::spdlog::error(__VA_ARGS__)
