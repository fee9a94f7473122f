#pragma once
/// \file version_info.hpp
/// \brief Provenance strings for `wlb --version` and trace metadata (the report that adds the
/// GEMM and NCCL backends is the driver's, app/main.cpp).

#include <string>

namespace wlb {

std::string gitHash();        ///< short git hash at configure time ("-dirty" if modified)
std::string versionString();  ///< wlb semantic version
std::string kokkosVersion();  ///< e.g. "3.4.1"
std::string kokkosBackend();  ///< default execution space, e.g. "Serial"
std::string mpiVersion();     ///< MPI library version string (first line)
std::string hdf5Version();    ///< e.g. "1.10.8 (parallel)"

}  // namespace wlb
