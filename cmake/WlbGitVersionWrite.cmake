# Writes OUTPUT from TEMPLATE with the git hash of SOURCE_DIR (WLB_GIT_HASH, "-dirty" when
# the tree differs from HEAD) and PROJECT_VERSION; configure_file leaves OUTPUT untouched
# when nothing changed, so only a new hash recompiles what includes it. Run at configure
# time (include) and at every build (cmake -P, target wlb_git_version).
set(WLB_GIT_HASH "unknown")
if(GIT_EXECUTABLE)
  execute_process(COMMAND ${GIT_EXECUTABLE} rev-parse --short=12 HEAD
    WORKING_DIRECTORY ${SOURCE_DIR}
    OUTPUT_VARIABLE _wlb_hash OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _wlb_rc)
  if(_wlb_rc EQUAL 0 AND _wlb_hash)
    set(WLB_GIT_HASH "${_wlb_hash}")
    execute_process(COMMAND ${GIT_EXECUTABLE} diff --quiet HEAD
      WORKING_DIRECTORY ${SOURCE_DIR} RESULT_VARIABLE _wlb_dirty ERROR_QUIET)
    if(NOT _wlb_dirty EQUAL 0)
      set(WLB_GIT_HASH "${WLB_GIT_HASH}-dirty")
    endif()
  endif()
endif()
configure_file(${TEMPLATE} ${OUTPUT} @ONLY)
