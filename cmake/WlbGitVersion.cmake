# The git hash for `wlb --version` and trace metadata, written at configure time and
# refreshed at every build (target wlb_git_version), so a build after new commits reports
# the commit it was built from, not the one it was configured at.
find_package(Git QUIET)
set(WLB_VERSION_HEADER ${CMAKE_BINARY_DIR}/generated/wlb/version.hpp)
set(SOURCE_DIR ${CMAKE_CURRENT_SOURCE_DIR})
set(TEMPLATE ${CMAKE_CURRENT_LIST_DIR}/wlb_version.hpp.in)
set(OUTPUT ${WLB_VERSION_HEADER})
include(${CMAKE_CURRENT_LIST_DIR}/WlbGitVersionWrite.cmake)
add_custom_target(wlb_git_version
  COMMAND ${CMAKE_COMMAND} -DGIT_EXECUTABLE=${GIT_EXECUTABLE} -DSOURCE_DIR=${CMAKE_CURRENT_SOURCE_DIR}
          -DTEMPLATE=${TEMPLATE} -DOUTPUT=${WLB_VERSION_HEADER} -DPROJECT_VERSION=${PROJECT_VERSION}
          -P ${CMAKE_CURRENT_LIST_DIR}/WlbGitVersionWrite.cmake
  BYPRODUCTS ${WLB_VERSION_HEADER}
  COMMENT "git hash for wlb --version"
  VERBATIM)
