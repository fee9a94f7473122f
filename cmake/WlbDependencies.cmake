# All third-party discovery and the Debian Kokkos target quirks live here, so the
# rest of the build only sees clean imported targets.

# --- Kokkos --------------------------------------------------------------------
# Debian ships Kokkos 3.4.1 inside Trilinos; a cluster build passes Kokkos_ROOT to a
# Kokkos 4.x install. No version range: 3.4's config file rejects them.
find_package(Kokkos REQUIRED)
if(Kokkos_VERSION VERSION_LESS 3.4)
  message(FATAL_ERROR "wlb needs Kokkos >= 3.4 (found ${Kokkos_VERSION})")
endif()
if(TARGET Kokkos::kokkos AND Kokkos_INCLUDE_DIRS)
  # Debian's Kokkos::kokkos names a non-existent include directory; point it at the
  # real one (/usr/include/trilinos). Harmless on a proper Kokkos 4.x install.
  get_target_property(_wlb_kk_inc Kokkos::kokkos INTERFACE_INCLUDE_DIRECTORIES)
  set(_wlb_kk_ok TRUE)
  foreach(_d IN LISTS _wlb_kk_inc)
    if(NOT _d MATCHES "^\\$<" AND NOT EXISTS "${_d}")
      set(_wlb_kk_ok FALSE)
    endif()
  endforeach()
  if(NOT _wlb_kk_ok)
    set_target_properties(Kokkos::kokkos PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${Kokkos_INCLUDE_DIRS}")
  endif()
endif()

# KokkosKernels: Debian has no version file and no Kokkos::kokkoskernels target. It must
# come from the same installation as Kokkos: one built for another Kokkos (e.g. Debian's
# Trilinos copy next to a CUDA Kokkos_ROOT) puts that Kokkos' headers on the include path
# and the kernels are instantiated for the wrong execution space. Without an explicit
# KokkosKernels_ROOT/_DIR, look only beside Kokkos; with one, insist on the same prefix.
get_filename_component(_wlb_kk_cmake_dir "${Kokkos_DIR}/.." ABSOLUTE)  # <prefix>/lib*/cmake
if(KokkosKernels_ROOT OR DEFINED ENV{KokkosKernels_ROOT} OR KokkosKernels_DIR)
  find_package(KokkosKernels QUIET)
else()
  find_package(KokkosKernels QUIET PATHS "${_wlb_kk_cmake_dir}" NO_DEFAULT_PATH)
endif()
if(KokkosKernels_FOUND OR KokkosKernels_DIR)
  get_filename_component(_wlb_kkk_cmake_dir "${KokkosKernels_DIR}/.." ABSOLUTE)
  if(KokkosKernels_DIR AND NOT _wlb_kkk_cmake_dir STREQUAL _wlb_kk_cmake_dir)
    message(FATAL_ERROR "KokkosKernels (${KokkosKernels_DIR}) is not from the Kokkos installation in use "
      "(${Kokkos_DIR}): its headers would mix two Kokkos versions. Point KokkosKernels_ROOT at the "
      "prefix of Kokkos_ROOT, or unset KokkosKernels_ROOT/KokkosKernels_DIR to build without it.")
  endif()
endif()
if(KokkosKernels_FOUND)
  message(STATUS "KokkosKernels: ${KokkosKernels_DIR} (same installation as Kokkos)")
else()
  message(STATUS "KokkosKernels: none beside ${_wlb_kk_cmake_dir}; GEMMs use the BLAS fallback")
endif()
add_library(wlb_kokkoskernels INTERFACE)
if(KokkosKernels_FOUND)
  target_compile_definitions(wlb_kokkoskernels INTERFACE WLB_HAVE_KOKKOSKERNELS=1)
endif()
if(TARGET Kokkos::kokkoskernels)
  target_link_libraries(wlb_kokkoskernels INTERFACE Kokkos::kokkoskernels)
elseif(KokkosKernels_LIBRARIES)
  target_include_directories(wlb_kokkoskernels INTERFACE ${KokkosKernels_INCLUDE_DIRS})
  target_link_directories(wlb_kokkoskernels INTERFACE ${KokkosKernels_LIBRARY_DIRS})
  target_link_libraries(wlb_kokkoskernels INTERFACE ${KokkosKernels_LIBRARIES})
endif()

# --- BLAS (GEMMs of the transformer layer) -----------------------------------------
find_package(PkgConfig REQUIRED)
pkg_check_modules(WLB_OPENBLAS QUIET IMPORTED_TARGET openblas)
if(WLB_OPENBLAS_FOUND)
  add_library(wlb_blas INTERFACE)
  target_link_libraries(wlb_blas INTERFACE PkgConfig::WLB_OPENBLAS)
  target_compile_definitions(wlb_blas INTERFACE WLB_HAVE_CBLAS=1)
else()
  find_package(BLAS REQUIRED)
  add_library(wlb_blas INTERFACE)
  target_link_libraries(wlb_blas INTERFACE BLAS::BLAS)
endif()

# --- MPI, parallel HDF5 --------------------------------------------------------------
find_package(MPI REQUIRED COMPONENTS C)
set(HDF5_PREFER_PARALLEL TRUE)
find_package(HDF5 REQUIRED COMPONENTS C)
if(NOT HDF5_IS_PARALLEL)
  message(FATAL_ERROR "wlb needs parallel HDF5 (Debian: libhdf5-openmpi-dev)")
endif()
if(NOT TARGET HDF5::HDF5)
  add_library(HDF5::HDF5 INTERFACE IMPORTED)
  target_include_directories(HDF5::HDF5 INTERFACE ${HDF5_C_INCLUDE_DIRS} ${HDF5_INCLUDE_DIRS})
  target_link_libraries(HDF5::HDF5 INTERFACE ${HDF5_C_LIBRARIES} ${HDF5_LIBRARIES})
  target_compile_definitions(HDF5::HDF5 INTERFACE ${HDF5_C_DEFINITIONS})
endif()

# --- Decks, CLI, JSON, logging ---------------------------------------------------
find_package(toml11 REQUIRED)
find_package(CLI11 REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(fmt REQUIRED)

# --- MILP (fixed-length optimal packing) -------------------------------------------
pkg_check_modules(WLB_CBC REQUIRED IMPORTED_TARGET cbc)

# --- NCCL (optional, compile/link only without a GPU) ------------------------------
if(WLB_ENABLE_NCCL)
  find_package(CUDAToolkit REQUIRED)
  find_path(WLB_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
  find_library(WLB_NCCL_LIB nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib
    /usr/local/cuda/lib64 /usr/local/cuda/lib)
  if(NOT WLB_NCCL_INCLUDE OR NOT WLB_NCCL_LIB)
    message(FATAL_ERROR "WLB_ENABLE_NCCL=ON but nccl.h / libnccl were not found")
  endif()
endif()

# --- Tests and benchmarks -------------------------------------------------------------
if(WLB_ENABLE_TESTS)
  find_package(GTest REQUIRED)
endif()
if(WLB_ENABLE_BENCH)
  find_package(benchmark REQUIRED)
endif()

# --- Common compile flags ------------------------------------------------------------
add_library(wlb_flags INTERFACE)
target_compile_options(wlb_flags INTERFACE -Wall -Wextra -Wno-unused-parameter)
# We use the MPI C API only; keep the deprecated C++ bindings out of every TU.
target_compile_definitions(wlb_flags INTERFACE OMPI_SKIP_MPICXX=1 MPICH_SKIP_MPICXX=1)
# nvcc's front end declares typedefs for host lambdas that GCC then reports as unused.
if(CMAKE_CXX_COMPILER MATCHES "nvcc_wrapper")
  target_compile_options(wlb_flags INTERFACE -Wno-unused-local-typedefs)
endif()
if(WLB_MARCH)
  include(CheckCXXCompilerFlag)
  check_cxx_compiler_flag(-march=${WLB_MARCH} WLB_HAS_MARCH_TARGET)
  if(NOT WLB_HAS_MARCH_TARGET)
    message(FATAL_ERROR "WLB_MARCH=${WLB_MARCH}: the compiler does not accept -march=${WLB_MARCH}")
  endif()
  target_compile_options(wlb_flags INTERFACE -march=${WLB_MARCH})
elseif(WLB_NATIVE)
  include(CheckCXXCompilerFlag)
  check_cxx_compiler_flag(-march=native WLB_HAS_MARCH_NATIVE)
  if(WLB_HAS_MARCH_NATIVE)
    target_compile_options(wlb_flags INTERFACE -march=native)
  endif()
endif()
if(WLB_ENABLE_SANITIZERS)
  target_compile_options(wlb_flags INTERFACE -fsanitize=address,undefined -fno-omit-frame-pointer)
  target_link_options(wlb_flags INTERFACE -fsanitize=address,undefined)
endif()
