#pragma once
/// \file error.hpp
/// \brief Error types shared by every component. The driver maps InputError to exit 2.

#include <new>
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

/// An output that could not be written for want of room (a full disk, a quota, a file-size
/// limit): nothing is wrong with the input or with wlb, but the run cannot finish. The driver
/// prints what() and ends every rank with exit 2 through MPI_Abort (HDF5 may hold state
/// after a failed write that its shutdown in MPI_Finalize would crash on).
class WriteError : public std::runtime_error {
 public:
  /// \param collective true when every rank raises it, so only rank 0 prints it.
  explicit WriteError(const std::string& what, bool collective = false)
      : std::runtime_error(what), collective_(collective) {}
  bool collective() const noexcept { return collective_; }

 private:
  bool collective_;
};

/// An allocation that failed after the activation pool gave back all it could: the deck
/// asks more of a rank than its memory holds. The driver prints what() with what to change
/// and exits 2, as for bad input.
class OutOfMemory : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Whether `e` is an allocation failure: OutOfMemory, std::bad_alloc (host allocations, and
/// Kokkos 3.4 to 4.x's RawMemoryAllocationFailure) or Kokkos' later std::runtime_error
/// "... memory space failed to allocate ..." (Impl::throw_bad_alloc), which has no type of
/// its own.
inline bool isOutOfMemory(const std::exception& e) {
  return dynamic_cast<const OutOfMemory*>(&e) != nullptr || dynamic_cast<const std::bad_alloc*>(&e) != nullptr ||
         std::string(e.what()).find("failed to allocate") != std::string::npos;
}

/// e.what() on one line: Kokkos' allocation errors end with a traceback note (or the
/// traceback) after a blank line.
inline std::string oneLine(const std::exception& e) {
  std::string w = e.what();
  w = w.substr(0, w.find("\n\n"));
  while (!w.empty() && (w.back() == '\n' || w.back() == ' ')) w.pop_back();
  return w;
}

}  // namespace wlb
