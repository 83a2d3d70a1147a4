# ml_dep_missing(NAME): stop the configure with one message naming the
# dependency NAME of cmake/deps.txt and the packages that provide it.
function(ml_dep_missing name)
  file(STRINGS ${CMAKE_SOURCE_DIR}/cmake/deps.txt lines REGEX "^[^#]")
  foreach(line IN LISTS lines)
    string(REPLACE "|" ";" fields "${line}")
    list(GET fields 0 n)
    string(STRIP "${n}" n)
    if(n STREQUAL name)
      list(GET fields 1 how)
      list(GET fields 2 deb)
      list(GET fields 3 rhel)
      string(STRIP "${how}" how)
      string(STRIP "${deb}" deb)
      string(STRIP "${rhel}" rhel)
      message(FATAL_ERROR
        "meshlm needs ${name} (${how}), which was not found. Install it: "
        "Debian/Ubuntu `apt-get install ${deb}` (or `make deps`), RHEL/Fedora `dnf install ${rhel}`; "
        "elsewhere point CMake at it (PKG_CONFIG_PATH, CMAKE_PREFIX_PATH).")
    endif()
  endforeach()
  message(FATAL_ERROR "meshlm needs ${name}, which was not found (cmake/deps.txt lacks it)")
endfunction()
