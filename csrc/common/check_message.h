// Error messages of the C++ ops, built without iostreams.
//
// RAGATTN_CHECK_VALUE / _TYPE / RAGATTN_CHECK are TORCH_CHECK_VALUE / _TYPE / TORCH_CHECK whose
// message pieces are joined here into one std::string and handed to torch as a single C string
// (torch's one-C-string overload of its message builder uses it as it is). TORCH_CHECK's own
// builder streams every piece into a std::ostringstream inside this extension, and on the GPU
// image (torch 2.11.0+cu130, g++ 13.3, Ubuntu's libstdc++) that crashed on the first integer.
// Such a stream is half torch's: torch's wheels are built with gcc-toolset-13 over an
// older libstdc++ and export their own copies of libstdc++ code (libc10.so: std::ostringstream's
// constructor), and torch's libraries come before libstdc++ on an extension's link line, so the
// extension's stream is constructed by torch's copy and written and destroyed by the system
// libstdc++ (LD_DEBUG=bindings shows it). Messages made of std::string appends and snprintf never
// touch that machinery. The condition is tested first and the message built only when it fails,
// as with TORCH_CHECK. tests/ops/test_cpp_error_messages.py checks every family's message.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

namespace ragattn {
namespace check_message {

inline void append(std::string& s, const char* p) { s += p; }
inline void append(std::string& s, const std::string& p) { s += p; }
inline void append(std::string& s, char c) { s += c; }

// Integers as iostream prints them (decimal); bool is refused: say what it means in words.
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                                           !std::is_same_v<T, char>, int> = 0>
void append(std::string& s, T v) {
  s += std::to_string(v);
}
void append(std::string& s, bool) = delete;

// Floating point as iostream's default (6 significant digits, %g: 0.5, 1e-07, nan, inf).
template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
void append(std::string& s, T v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
  s += buf;
}

// torch's spellings: ScalarType as its operator<< (Float, Half, ...), Device as "cpu" / "cuda:0",
// a shape as "[2, 3]".
inline void append(std::string& s, at::ScalarType t) { s += c10::toString(t); }
inline void append(std::string& s, const c10::Device& d) { s += d.str(); }
inline void append(std::string& s, c10::IntArrayRef shape) {
  s += '[';
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  s += ']';
}

template <typename... Args>
std::string join(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}

}  // namespace check_message
}  // namespace ragattn

// The message is a temporary that lives to the end of the throw expression, where c10::Error
// copies it.
#define RAGATTN_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::ragattn::check_message::join(__VA_ARGS__).c_str())
#define RAGATTN_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, ::ragattn::check_message::join(__VA_ARGS__).c_str())
#define RAGATTN_CHECK(cond, ...) TORCH_CHECK(cond, ::ragattn::check_message::join(__VA_ARGS__).c_str())
