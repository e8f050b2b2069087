// Calls an emulated kernel with its arguments passed as 64-bit slots (pointer, integer or float bits), so one
// generic entry per kernel serves ctypes; emu_arity_<name> lets the test check the argument count.
#pragma once
#include <type_traits>
#include <utility>

namespace emu {
template <typename T> T from_slot(uint64_t s) {
  if constexpr (std::is_pointer_v<T>) return (T)(uintptr_t)s;
  else if constexpr (std::is_same_v<T, float>) { uint32_t u = (uint32_t)s; float f; memcpy(&f, &u, 4); return f; }
  else return (T)(int64_t)s;
}
template <typename... P, size_t... I> void invoke_impl(void (*f)(P...), const uint64_t* s, std::index_sequence<I...>) {
  f(from_slot<P>(s[I])...);
}
template <typename... P> void invoke(void (*f)(P...), const uint64_t* s) { invoke_impl(f, s, std::index_sequence_for<P...>{}); }
template <typename... P> int arity(void (*)(P...)) { return (int)sizeof...(P); }
}  // namespace emu

#define EMU_ENTRY(name)                                                                                     \
  extern "C" void emu_##name(unsigned gx, unsigned gy, unsigned gz, unsigned bx, const uint64_t* s) {      \
    emu::launch(dim3u{gx, gy, gz}, dim3u{bx, 1, 1}, [&] { emu::invoke(name, s); });                       \
  }                                                                                                         \
  extern "C" int emu_arity_##name() { return emu::arity(name); }
