#pragma once
/// \file
/// Host functions: user C++ ops whose forward runs as a unit and whose backward is a user
/// function on Variables (docs/api.md "Host functions"; modelled on libtorch's
/// `torch::autograd::Function<T>`, the seed's PythonOp).
///
/// ```cpp
/// struct MulConstant : sj::HostFunction<MulConstant> {
///   static sj::Variable forward(sj::HostContext* ctx, sj::Variable x, double c);
///   static sj::variable_list backward(sj::HostContext* ctx, sj::variable_list grads);
/// };
/// ```
/// Non-Variable arguments are the node's scalars; their order makes the calling convention
/// (`t` tensor, `s` scalar). The forward runs without grad mode. Unless
/// `static constexpr bool traceable = true`, the trace hook is suspended during forward and
/// backward and sees one host op / one opaque backward (`record_eval`). When the backward
/// runs with create_graph, its results get an `Eval` grad_fn, so the backward of the
/// backward is opaque again. As in libtorch, a gradient the backward returns in another
/// dtype than its input's is cast to the input's dtype, and, as libtorch's
/// `validate_outputs`, a gradient of a shape the input's shape broadcasts to is summed
/// back to the input's shape ([2, 3] or [1, 3] for an input [3]); gradients past the
/// forward's arguments are dropped when undefined (libtorch's `CppNode<T>::apply`).
/// Errors, naming the function and the input: a backward returning the wrong number of
/// gradients (`Error`), a gradient of a shape the input does not broadcast to
/// (`ShapeError`) or on another device than its input (`Error`). Arguments: see
/// `HostArgument`; a string argument reaches a compiled call's re-run as `std::string`, so
/// forward takes strings as `std::string` / `const std::string&` (a `const char*`
/// parameter is refused by a static_assert).

#include <stagejit/autograd/function.hpp>
#include <stagejit/autograd/grad_mode.hpp>
#include <stagejit/autograd/saved_variable.hpp>
#include <stagejit/autograd/trace_hook.hpp>
#include <stagejit/autograd/variable.hpp>
#include <stagejit/core/aten_dispatch.hpp>
#include <stagejit/core/error.hpp>
#include <stagejit/core/scalar.hpp>

#include <boost/core/demangle.hpp>

#include <concepts>
#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <vector>

namespace stagejit {

/// The context a host function's forward fills for its backward.
class HostContext {
 public:
  /// Saves Variables for backward (inputs or outputs of the forward; outputs are saved
  /// without a reference cycle).
  void save_for_backward(variable_list variables) { to_save_ = std::move(variables); }
  /// The saved Variables (call from backward).
  variable_list get_saved_variables() const;
  /// Arbitrary scalars for backward.
  std::unordered_map<std::string, Scalar> saved_data;

  /// Internal: called once the forward's outputs and backward Function are known.
  void finalize(const variable_list& outputs, const std::shared_ptr<Function>& owner);

 private:
  variable_list to_save_;
  std::vector<SavedVariable> saved_;
  std::weak_ptr<Function> owner_;
  bool finalized_ = false;
};

namespace detail {

/// Wraps outputs, creates the HostBackward (when needed) and reports the host op to the
/// trace hook. Returns the backward Function or null. Outputs may be replaced by new
/// Variables (an input returned as is becomes a new Variable sharing the tensor).
std::shared_ptr<Function> finish_host_call(
    const std::string& name, const std::shared_ptr<HostContext>& ctx,
    const variable_list& inputs, variable_list& outputs,
    std::function<variable_list(HostContext*, variable_list)> backward, bool traceable,
    const std::string& calling_convention, const std::vector<Scalar>& scalars,
    const HostCallable& call);

/// The argument as stored for a re-run: Variables are replaced by undefined placeholders
/// (the re-run takes new tensors), a string (`std::string`, literal, `const char*`)
/// becomes a `std::string`, everything else is copied. Called before the forward runs, so
/// an rvalue argument that forward moves from is stored intact.
template <class A>
auto stored_argument(const A& a) {
  using D = std::remove_cvref_t<A>;
  if constexpr (std::is_same_v<D, Variable>) return Variable();
  else if constexpr (std::is_convertible_v<const D&, std::string> && !std::is_arithmetic_v<D>)
    return std::string(a);
  else return D(a);
}

/// The type `stored_argument` keeps for an argument of type `A`.
template <class A>
using stored_argument_t = decltype(stored_argument(std::declval<const std::remove_cvref_t<A>&>()));

/// Whether `T::forward(HostContext*, A...)` can be called.
template <class T, class... A>
concept host_forward_callable = requires(HostContext* c) { T::forward(c, std::declval<A>()...); };

/// The argument for a re-run: the next tensor input for a Variable, else the stored value.
template <class A>
decltype(auto) rerun_argument(const A& stored, const variable_list& inputs, std::size_t& next) {
  if constexpr (std::is_same_v<A, Variable>) {
    STAGEJIT_CHECK(next < inputs.size(), "host function re-run: expected more than ",
                   inputs.size(), " tensor inputs");
    return Variable(inputs[next++]);
  } else {
    return (stored);
  }
}

template <class A>
constexpr bool is_host_argument() {
  using D = std::remove_cvref_t<A>;
  return std::is_same_v<D, Variable> || std::is_arithmetic_v<D> ||
         std::is_convertible_v<const D&, std::string> ||
         std::is_same_v<D, std::vector<int64_t>> || std::is_same_v<D, std::vector<double>>;
}

}  // namespace detail

/// A type `HostFunction::apply` takes as an argument (with any reference and const): a
/// `Variable` (a tensor input of the HostOp node) or a value the IR keeps among the node's
/// scalars (`Scalar`): bool, an integer, a floating-point number, a string (`std::string`,
/// a literal or `const char*`; stored as `std::string`), `std::vector<int64_t>` or
/// `std::vector<double>`. Anything else, a user struct in particular, is refused at
/// compile time: a HostOp's scalars are printed in the IR (`^Name(scalars)`), read back
/// by the parser and compared when graphs are compared, and an opaque struct could take
/// part in none of these (two calls with different structs would print alike). Pass a
/// struct's fields as separate arguments instead.
template <class A>
concept HostArgument = detail::is_host_argument<A>();

namespace detail {

template <class A>
void collect_argument(const A& a, variable_list& inputs, std::vector<Scalar>& scalars,
                      std::string& convention) {
  using D = std::remove_cvref_t<A>;
  if constexpr (std::is_same_v<D, Variable>) {
    inputs.push_back(a);
    convention += 't';
  } else if constexpr (std::is_same_v<D, bool>) {
    scalars.emplace_back(a);
    convention += 's';
  } else if constexpr (std::is_integral_v<D>) {
    scalars.emplace_back(static_cast<int64_t>(a));
    convention += 's';
  } else if constexpr (std::is_floating_point_v<D>) {
    scalars.emplace_back(static_cast<double>(a));
    convention += 's';
  } else if constexpr (std::is_convertible_v<const D&, std::string>) {
    scalars.emplace_back(std::string(a));
    convention += 's';
  } else if constexpr (std::is_same_v<D, std::vector<int64_t>> ||
                       std::is_same_v<D, std::vector<double>>) {
    scalars.emplace_back(a);
    convention += 's';
  }
  // Anything else is refused by HostFunction::apply's static_assert (HostArgument).
}

template <class T>
std::string host_function_name() {
  if constexpr (requires { T::name; }) {
    return std::string(T::name);
  } else {
    std::string n = boost::core::demangle(typeid(T).name());
    auto pos = n.rfind("::");
    return pos == std::string::npos ? n : n.substr(pos + 2);
  }
}

/// Whether a compiled call's re-run (which passes the stored copies of the arguments,
/// `stored_argument_t`, as lvalues) can call `T::forward`; else it passes them as rvalues
/// (a forward taking `std::vector<double>&&`). The stored copies are the re-run's own.
template <class T, class... Args>
inline constexpr bool rerun_by_lvalue = host_forward_callable<T, stored_argument_t<Args>&...>;
template <class T, class... Args>
inline constexpr bool rerun_by_rvalue = host_forward_callable<T, stored_argument_t<Args>&&...>;

}  // namespace detail

/// CRTP base of host functions; see the file comment.
template <class T>
struct HostFunction {
  /// Runs `T::forward(ctx, args...)` as one op. Returns what forward returns
  /// (`Variable` or `variable_list`). Each argument is a `HostArgument`, passed to
  /// forward as given (an rvalue forwarded as an rvalue). While a trace records the call
  /// (inside `compile()`), the non-Variable arguments are first copied for the compiled
  /// calls' re-runs, which pass those copies (strings as `std::string`) to forward again:
  /// forward must accept them as well (checked at compile time).
  template <class... Args>
  static auto apply(Args&&... args) {
    static_assert((HostArgument<Args> && ...),
                  "HostFunction::apply: every argument must be a Variable or a value the IR keeps as a "
                  "HostOp scalar: bool, an integer, a floating-point number, a string (std::string, "
                  "literal, const char*), std::vector<int64_t> or std::vector<double>. A struct is "
                  "refused (the IR could not print, parse or compare it): pass its fields instead "
                  "(see stagejit::HostArgument)");
    static_assert(detail::host_forward_callable<T, Args&&...>,
                  "HostFunction::apply: T::forward(HostContext*, args...) cannot be called with these "
                  "arguments");
    constexpr bool traceable = [] {
      if constexpr (requires { T::traceable; }) return static_cast<bool>(T::traceable);
      else return false;
    }();
    // A compiled call re-runs forward with the stored copies of the arguments: a string is
    // stored as std::string (the caller's literal or pointer may be gone by then), so a
    // forward parameter of type `const char*` cannot take it. Checked by hand: a host
    // forward(HostContext*, Variable, const char*) stops here with this message.
    constexpr bool rerunnable =
        traceable || detail::rerun_by_lvalue<T, Args...> || detail::rerun_by_rvalue<T, Args...>;
    static_assert(rerunnable,
                  "HostFunction: T::forward must also accept its arguments as stored for the re-runs "
                  "of a compiled call: strings (literals, const char*) as std::string, Variables, "
                  "numbers and vectors as copies; declare a string parameter std::string or "
                  "const std::string&, not const char*");
    // Never on meta tensors: forward is the user's code (compile() then traces the real ones).
    STAGEJIT_CHECK_AS(TraceError, !MetaTraceScope::active(), "HostFunction: not run inside a meta trace");
    variable_list inputs;
    std::vector<Scalar> scalars;
    std::string convention;
    (detail::collect_argument(args, inputs, scalars, convention), ...);
    using Stored = std::tuple<detail::stored_argument_t<Args>...>;
    // Copied before forward runs: forward may move from an rvalue argument.
    std::optional<Stored> stored;
    if constexpr (!traceable && rerunnable)
      if (current_trace_hook()) stored.emplace(detail::stored_argument(args)...);
    auto ctx = std::make_shared<HostContext>();
    using R = decltype(T::forward(ctx.get(), std::forward<Args>(args)...));
    static_assert(std::is_same_v<R, Variable> || std::is_same_v<R, variable_list>,
                  "HostFunction: forward must return Variable or variable_list");
    variable_list outputs;
    {
      NoGradGuard no_grad;
      AtenAutogradKeys user_code;  // Note [Below libtorch's autograd keys]
      std::optional<TraceHookGuard> suspend;
      if (!traceable) suspend.emplace(nullptr);
      if constexpr (std::is_same_v<R, Variable>) {
        outputs.push_back(T::forward(ctx.get(), std::forward<Args>(args)...));
      } else {
        outputs = T::forward(ctx.get(), std::forward<Args>(args)...);
      }
    }
    HostCallable call;
    if constexpr (!traceable && rerunnable) {
      if (stored) {
        call = [stored = std::move(*stored)](const variable_list& in) -> variable_list {
          return std::apply(
              [&in](const auto&... a) -> variable_list {
                std::size_t next = 0;
                // Braced initialisation evaluates the arguments left to right. The copies
                // are this re-run's own: forward may move from them.
                auto args2 = std::tuple<std::remove_cvref_t<decltype(a)>...>{
                    detail::rerun_argument(a, in, next)...};
                STAGEJIT_CHECK(next == in.size(), "host function re-run: given ", in.size(),
                               " tensor inputs, the call takes ", next);
                auto r = std::apply(
                    [](auto&... x) {
                      if constexpr (detail::rerun_by_lvalue<T, Args...>) return HostFunction<T>::apply(x...);
                      else return HostFunction<T>::apply(std::move(x)...);
                    },
                    args2);
                if constexpr (std::is_same_v<decltype(r), Variable>) return {r};
                else return r;
              },
              stored);
        };
      }
    }
    detail::finish_host_call(
        detail::host_function_name<T>(), ctx, inputs, outputs,
        [](HostContext* c, variable_list g) { return T::backward(c, std::move(g)); },
        traceable, convention, scalars, call);
    if constexpr (std::is_same_v<R, Variable>) {
      return outputs[0];
    } else {
      return outputs;
    }
  }
};

}  // namespace stagejit
