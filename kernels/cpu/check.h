// Our operators' input checks. TORCH_CHECK writes its message's pieces into an ostringstream compiled
// into this library; built by a toolchain that links newer parts of libstdc++ statically (the GPU
// machine's image, 2026-11), writing a number there crashed the process (SIGSEGV in
// ostream::_M_insert<long>) instead of raising. ROSECHAT_CHECK joins the pieces with std::to_string and
// hands TORCH_CHECK one string, which it passes on untouched: no stream.
#pragma once

#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

namespace rosechat {

inline std::string message_piece(const char* s) { return s; }
inline std::string message_piece(const std::string& s) { return s; }
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
std::string message_piece(T v) { return std::to_string(v); }

template <typename... A>
std::string message(const A&... pieces) { return (std::string{} + ... + message_piece(pieces)); }

}  // namespace rosechat

#define ROSECHAT_CHECK(cond, ...) TORCH_CHECK(cond, ::rosechat::message(__VA_ARGS__))
