// A temporary directory for one test process's files (generated models, Lua
// scripts), removed when that process exits. ctest runs every test case in
// a process of its own, and a generated model is megabytes: directories left
// behind per process filled a developer's disk.
// Header-only (the test globs compile only *.cpp).
#pragma once

#include <unistd.h>

#include <filesystem>
#include <map>
#include <string>
#include <system_error>

namespace cleave::test {

// <temp dir>/<prefix>-<pid>, made on first use; removed at exit by the
// process that made it (a forked child that exits leaves it to its parent).
inline std::filesystem::path process_scratch(const std::string& prefix) {
  struct Dirs {
    pid_t owner = ::getpid();
    std::map<std::string, std::filesystem::path> made;
    ~Dirs() {
      if (::getpid() != owner) return;
      std::error_code ec;
      for (const auto& [name, dir] : made) std::filesystem::remove_all(dir, ec);
    }
  };
  static Dirs dirs;
  auto it = dirs.made.find(prefix);
  if (it != dirs.made.end()) return it->second;
  std::filesystem::path dir = std::filesystem::temp_directory_path() / (prefix + "-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dirs.made.emplace(prefix, dir).first->second;
}

}  // namespace cleave::test
