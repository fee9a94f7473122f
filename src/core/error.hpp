#pragma once
/// \file error.hpp
/// \brief Error types shared by every component. The driver maps InputError to exit 2.

#include <stdexcept>
#include <string>

namespace wlb {

/// Bad user input (deck, length file, dataset, plan file, mesh shape). The driver prints
/// what() and exits with code 2 without writing outputs.
class InputError : public std::runtime_error {
 public:
  /// \param collective true when every rank raises the same error (e.g. a mesh that
  /// does not match the world size), so only rank 0 needs to print it.
  explicit InputError(const std::string& what, bool collective = false)
      : std::runtime_error(what), collective_(collective) {}
  bool collective() const noexcept { return collective_; }

 private:
  bool collective_;
};

/// Exit code used for every kind of bad input.
inline constexpr int kExitBadInput = 2;

}  // namespace wlb
