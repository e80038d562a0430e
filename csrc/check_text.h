// Numbers in the bindings' TORCH_CHECK messages, as text. On the lent H200's image, an integer formatted by the
// ostream of c10::str inside these extensions segfaults the process instead of raising (session 48: cuda-gdb stopped
// in ostream::_M_insert<long> called from ds4_ext.so while a message was formed; strings stream fine), so every
// number in a message goes through num() or dims(): std::to_string, no ostream and no locale facet.
#pragma once
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>

namespace ds4_text {

inline std::string num(long long v) { return std::to_string(v); }

inline std::string dims(c10::IntArrayRef d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

}  // namespace ds4_text
