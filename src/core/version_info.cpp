#include "core/version_info.hpp"

#include <hdf5.h>
#include <mpi.h>

#include "core/kokkos_compat.hpp"
#include "wlb/version.hpp"

namespace wlb {

std::string gitHash() { return WLB_GIT_HASH; }
std::string versionString() { return WLB_VERSION_STRING; }
std::string kokkosVersion() { return kk::versionString(); }
std::string kokkosBackend() { return kk::backendName(); }

std::string mpiVersion() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(buf, &len);
  std::string s(buf, static_cast<std::size_t>(len));
  const auto nl = s.find_first_of("\r\n");
  if (nl != std::string::npos) s.resize(nl);
  const auto comma = s.find(',');  // OpenMPI appends the package and date
  if (comma != std::string::npos) s.resize(comma);
  int major = 0, minor = 0;
  MPI_Get_version(&major, &minor);
  return s + " (MPI " + std::to_string(major) + "." + std::to_string(minor) + ")";
}

std::string hdf5Version() {
  unsigned maj = 0, min = 0, rel = 0;
  H5get_libversion(&maj, &min, &rel);
  std::string s = std::to_string(maj) + "." + std::to_string(min) + "." + std::to_string(rel);
#ifdef H5_HAVE_PARALLEL
  s += " (parallel)";
#endif
  return s;
}

}  // namespace wlb
