// Files the user names on the command line: checked before any work, read with a cap, and
// results written atomically. Every error names the option (or what the file is for), the
// path and the reason, with errno's text where the system gave one.
//
//   file_read             whole file as bytes, at most max_bytes; a directory or an
//                         unreadable path is an Error, as is anything longer than the cap
//                         (so /dev/zero or a huge file cannot exhaust memory)
//   file_check_input      the path names something readable that is not a directory
//   file_check_regular    the path names a readable regular file (stat before open: a FIFO
//                         with no writer would block open() forever, a device never ends)
//   file_check_output     a file can be created or replaced at path (its folder exists and
//                         is writable; path is not a folder; its temporary name fits the
//                         file system's name limit); nothing is written
//   file_check_distinct   no output names the same file as an input or another output
//   dir_check_output      a folder exists or can be created at path; nothing is created
//   file_write_atomic     writes to a temporary file beside path, then renames it over
//                         path: a failed or interrupted write never leaves a partial file
//                         in place of a good one
//   file_write_atomic_stream
//                         the same, with the bytes produced in pieces (outputs too large to
//                         build in memory first, such as KV snapshots)
//   file_temp_cleanup_on_signals
//                         SIGINT and SIGTERM remove the temporary files of writes in flight
//                         before the process dies of the signal (a program calls it once)
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace cumulus {

inline constexpr size_t kFileReadDefaultMax = size_t{256} << 20;  // 256 MiB

std::string file_read(const std::string& path, std::string_view what, size_t max_bytes = kFileReadDefaultMax);
void file_check_input(const std::string& path, std::string_view what);
void file_check_regular(const std::string& path, std::string_view what);
void file_check_output(const std::string& path, std::string_view what);
// One path a command reads (output = false) or writes, with the option that names it.
struct FilePathUse {
  std::string what;
  std::string path;  // empty: not given, skipped
  bool output = false;
};
// Throws Error naming both options and the path when an output is the same file as an
// input or as another output: by device and inode where the file exists (a hard link, a
// symbolic link or another spelling of the path is caught), else by the absolute,
// normalised path. Nothing is created or read.
void file_check_distinct(const std::vector<FilePathUse>& paths);
void dir_check_output(const std::string& path, std::string_view what);
void file_write_atomic(const std::string& path, std::string_view bytes, std::string_view what);
// `fill` is called once with a function that appends bytes to the temporary file; when
// fill throws, the temporary file is removed and the exception passes on.
using FileAppend = std::function<void(std::string_view)>;
void file_write_atomic_stream(const std::string& path, std::string_view what,
                              const std::function<void(const FileAppend&)>& fill);
// Installs SIGINT and SIGTERM handlers that unlink the temporary files of the writes in
// flight (file_write_atomic*), then die of the signal as before. Process-wide: for programs
// (the CLI), never called by the library itself.
void file_temp_cleanup_on_signals();
// The characters a temporary name adds to an output's file name (".NAME.tmp-XXXXXX").
inline constexpr size_t kFileTempNameExtra = 12;

}  // namespace cumulus
