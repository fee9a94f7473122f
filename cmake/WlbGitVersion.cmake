# Record the git hash at configure time for `wlb --version` and trace metadata.
find_package(Git QUIET)
set(WLB_GIT_HASH "unknown")
if(GIT_FOUND)
  execute_process(COMMAND ${GIT_EXECUTABLE} rev-parse --short=12 HEAD
    WORKING_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}
    OUTPUT_VARIABLE _wlb_hash OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _wlb_rc)
  if(_wlb_rc EQUAL 0 AND _wlb_hash)
    set(WLB_GIT_HASH "${_wlb_hash}")
    execute_process(COMMAND ${GIT_EXECUTABLE} diff --quiet HEAD
      WORKING_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR} RESULT_VARIABLE _wlb_dirty ERROR_QUIET)
    if(NOT _wlb_dirty EQUAL 0)
      set(WLB_GIT_HASH "${WLB_GIT_HASH}-dirty")
    endif()
  endif()
endif()
configure_file(${CMAKE_CURRENT_LIST_DIR}/wlb_version.hpp.in
  ${CMAKE_BINARY_DIR}/generated/wlb/version.hpp @ONLY)
