#include "parallel/comm.hpp"

#include <vector>

#include "core/error.hpp"

namespace wlb::parallel {

Comm Comm::duplicate(MPI_Comm comm) {
  Comm c;
  MPI_Comm_dup(comm, &c.comm_);
  return c;
}

Comm Comm::adopt(MPI_Comm comm) {
  Comm c;
  c.comm_ = comm;
  return c;
}

Comm::~Comm() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
}

Comm& Comm::operator=(Comm&& o) noexcept {
  if (this != &o) {
    Comm tmp(std::move(*this));
    comm_ = std::exchange(o.comm_, MPI_COMM_NULL);
  }
  return *this;
}

int Comm::rank() const {
  int r = 0;
  MPI_Comm_rank(comm_, &r);
  return r;
}

int Comm::size() const {
  int s = 0;
  MPI_Comm_size(comm_, &s);
  return s;
}

void Comm::barrier() const { MPI_Barrier(comm_); }

bool allOk(MPI_Comm comm, bool ok) {
  int local = ok ? 1 : 0, global = 0;
  MPI_Allreduce(&local, &global, 1, MPI_INT, MPI_MIN, comm);
  return global == 1;
}

void throwIfAnyFailed(MPI_Comm comm, const std::string& error) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  int failed = error.empty() ? size : rank, first = size;
  MPI_Allreduce(&failed, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first == size) return;
  // Ship the lowest failing rank's message to everyone.
  int len = rank == first ? static_cast<int>(error.size()) : 0;
  MPI_Bcast(&len, 1, MPI_INT, first, comm);
  std::string msg(static_cast<std::size_t>(len), '\0');
  if (rank == first) msg = error;
  MPI_Bcast(msg.data(), len, MPI_CHAR, first, comm);
  throw InputError("rank " + std::to_string(first) + ": " + msg, /*collective=*/true);
}

std::string bcastString(MPI_Comm comm, const std::string& s) {
  long long n = static_cast<long long>(s.size());
  MPI_Bcast(&n, 1, MPI_LONG_LONG, 0, comm);
  std::string out = s;
  out.resize(static_cast<std::size_t>(n));
  if (n > 0) MPI_Bcast(out.data(), static_cast<int>(n), MPI_CHAR, 0, comm);
  return out;
}

}  // namespace wlb::parallel
