# `cmake --install` exports ferry::ferry so that another project can find_package(ferry).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# The installed libferry.so finds its private shared dependencies (oneTBB, spdlog and its fmt) through
# its RUNPATH: the consumer's linker looks there for a library's needed libraries, and so does the
# loader. INSTALL_RPATH_USE_LINK_PATH alone skips libraries inside the build tree (where gpu_check.sh
# once unpacked the carried Debian packages: a consumer then failed to link with "libtbb.so.12, needed
# by libferry.so, not found"), so the directories are named explicitly, wherever the libraries came from.
set(FERRY_PRIVATE_LIB_DIRS "")
foreach(dep TBB::tbb spdlog::spdlog fmt::fmt)
  if(NOT TARGET ${dep})
    continue()
  endif()
  foreach(prop IMPORTED_LOCATION_RELEASE IMPORTED_LOCATION_RELWITHDEBINFO IMPORTED_LOCATION_NONE
               IMPORTED_LOCATION_NOCONFIG IMPORTED_LOCATION)
    get_target_property(location ${dep} ${prop})
    if(location)
      get_filename_component(dir "${location}" DIRECTORY)
      if(NOT dir IN_LIST CMAKE_CXX_IMPLICIT_LINK_DIRECTORIES)
        list(APPEND FERRY_PRIVATE_LIB_DIRS "${dir}")
      endif()
      break()
    endif()
  endforeach()
endforeach()
list(REMOVE_DUPLICATES FERRY_PRIVATE_LIB_DIRS)
set_target_properties(ferry PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON INSTALL_RPATH "${FERRY_PRIVATE_LIB_DIRS}")
if(FERRY_PRIVATE_LIB_DIRS)
  message(STATUS "ferry: installed libferry.so finds its private dependencies in ${FERRY_PRIVATE_LIB_DIRS}")
endif()
install(TARGETS ferry EXPORT ferryTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES ferry.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/ferry)
foreach(dir common chunk scheduler cpu_adam hooks dist optim)
  install(DIRECTORY ${dir}/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/ferry/${dir}
    FILES_MATCHING PATTERN "*.h" PATTERN "kernels" EXCLUDE)
endforeach()

install(EXPORT ferryTargets NAMESPACE ferry:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ferry)
configure_package_config_file(cmake/ferryConfig.cmake.in
  "${CMAKE_CURRENT_BINARY_DIR}/ferryConfig.cmake"
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ferry)
write_basic_package_version_file("${CMAKE_CURRENT_BINARY_DIR}/ferryConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion)
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/ferryConfig.cmake" "${CMAKE_CURRENT_BINARY_DIR}/ferryConfigVersion.cmake"
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/ferry)
