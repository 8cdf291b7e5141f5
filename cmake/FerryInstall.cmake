# `cmake --install` exports ferry::ferry so that another project can find_package(ferry).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set_target_properties(ferry PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
install(TARGETS ferry EXPORT ferryTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES ferry.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/ferry)
foreach(dir common chunk scheduler cpu_adam hooks dist)
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
