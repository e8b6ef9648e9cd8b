#pragma once
/// \file
/// The printed names of a graph's values, shared by the printer and by `lint`'s
/// messages: a value with a debug name prints as `%name`; the others are numbered
/// `%0, %1, ...` in print order (graph inputs, then node outputs in list order).
///
/// The longer members' bodies are in ir/detail/names-inl.hpp (core/config.hpp).

#include <string>
#include <unordered_map>

#include <stagejit/core/config.hpp>
#include <stagejit/ir/graph.hpp>

namespace stagejit::ir::detail {

class NameTable {
 public:
  explicit NameTable(const Graph& g);
  /// `%name` of `v`; values outside the list (unlisted nodes) print as `%#<id>`.
  std::string operator()(const Value* v) const {
    auto it = names_.find(v);
    if (it != names_.end()) return it->second;
    return "%#" + std::to_string(v->id());
  }
  /// A node for messages: its outputs' names and what it is, e.g. `%3 (mul)`.
  std::string node(const Node* n) const;

 private:
  void assign(const Value* v) {
    names_[v] = v->has_name() ? "%" + v->name() : "%" + std::to_string(next_++);
  }
  std::unordered_map<const Value*, std::string> names_;
  size_t next_ = 0;
};

}  // namespace stagejit::ir::detail
