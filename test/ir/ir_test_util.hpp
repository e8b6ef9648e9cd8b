#pragma once
// Helpers shared by the IR tests.
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

inline std::string read_text_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
