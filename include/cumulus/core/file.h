// Files the user names on the command line: checked before any work, read with a cap, and
// results written atomically. Every error names the option (or what the file is for), the
// path and the reason, with errno's text where the system gave one.
//
//   file_read             whole file as bytes, at most max_bytes; a directory or an
//                         unreadable path is an Error, as is anything longer than the cap
//                         (so /dev/zero or a huge file cannot exhaust memory)
//   file_check_input      the path names something readable that is not a directory
//   file_check_output     a file can be created or replaced at path (its folder exists and
//                         is writable; path is not a folder); nothing is written
//   dir_check_output      a folder exists or can be created at path; nothing is created
//   file_write_atomic     writes to a temporary file beside path, then renames it over
//                         path: a failed or interrupted write never leaves a partial file
//                         in place of a good one
//   file_write_atomic_stream
//                         the same, with the bytes produced in pieces (outputs too large to
//                         build in memory first, such as KV snapshots)
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

namespace cumulus {

inline constexpr size_t kFileReadDefaultMax = size_t{256} << 20;  // 256 MiB

std::string file_read(const std::string& path, std::string_view what, size_t max_bytes = kFileReadDefaultMax);
void file_check_input(const std::string& path, std::string_view what);
void file_check_output(const std::string& path, std::string_view what);
void dir_check_output(const std::string& path, std::string_view what);
void file_write_atomic(const std::string& path, std::string_view bytes, std::string_view what);
// `fill` is called once with a function that appends bytes to the temporary file; when
// fill throws, the temporary file is removed and the exception passes on.
using FileAppend = std::function<void(std::string_view)>;
void file_write_atomic_stream(const std::string& path, std::string_view what,
                              const std::function<void(const FileAppend&)>& fill);

}  // namespace cumulus
