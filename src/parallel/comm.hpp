#pragma once
/// \file comm.hpp
/// \brief Owning MPI communicator wrapper (duplicates on construction, frees on
/// destruction) and the failure-flag combination every multi-rank path uses.

#include <mpi.h>

#include <string>
#include <utility>

namespace wlb::parallel {

class Comm {
 public:
  Comm() = default;
  /// Duplicate `comm` (collective over it); the copy is freed by the destructor.
  static Comm duplicate(MPI_Comm comm);
  /// Take ownership of a communicator created elsewhere (e.g. by MPI_Comm_split).
  static Comm adopt(MPI_Comm comm);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;
  Comm(Comm&& o) noexcept : comm_(std::exchange(o.comm_, MPI_COMM_NULL)) {}
  Comm& operator=(Comm&& o) noexcept;

  MPI_Comm get() const { return comm_; }
  operator MPI_Comm() const { return comm_; }  // NOLINT(google-explicit-constructor)
  bool valid() const { return comm_ != MPI_COMM_NULL; }
  int rank() const;
  int size() const;
  void barrier() const;

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

/// True on every rank iff `ok` is true on every rank of `comm` (one Allreduce). Used
/// wherever one rank can fail alone, so no rank waits forever in a later collective.
bool allOk(MPI_Comm comm, bool ok);

/// Collective error check: if any rank of `comm` has a non-empty `error`, every rank
/// throws InputError. The lowest failing rank's message is used (prefixed with its rank
/// unless `collective_message`), so all ranks report one clear message.
void throwIfAnyFailed(MPI_Comm comm, const std::string& error);

/// Rank 0's `s` on every rank of `comm` (collective; the others' `s` is ignored).
std::string bcastString(MPI_Comm comm, const std::string& s);

}  // namespace wlb::parallel
