# ctest Install.FindPackageConsumer: installs the build tree into a fresh prefix
# (cmake --install), then configures, builds and runs tests/install as a separate project
# that finds it with find_package(cumulus).
#   cmake -DBUILD_DIR=<build tree> -DWORK_DIR=<scratch> -DSOURCE_DIR=<repo> [-DGENERATOR=Ninja]
#         [-DCXX=<compiler>] -P tests/install/run.cmake
foreach(var BUILD_DIR WORK_DIR SOURCE_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run.cmake: ${var} is not set")
  endif()
endforeach()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "failed (${rc}): ${cmd}")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
set(args -S ${SOURCE_DIR}/tests/install -B ${WORK_DIR}/build -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix
    -DCMAKE_BUILD_TYPE=Release)
if(DEFINED GENERATOR)
  list(APPEND args -G ${GENERATOR})
endif()
if(DEFINED CXX)
  list(APPEND args -DCMAKE_CXX_COMPILER=${CXX})
endif()
run(${CMAKE_COMMAND} ${args})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)
