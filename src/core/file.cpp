// Checked reading and atomic writing of user-named files (core/file.h).
#include "cumulus/core/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/check.h"

namespace cumulus {
namespace {

namespace fs = std::filesystem;

std::string errno_text(int err) { return std::strerror(err); }

// The folder a file at `path` lives in ("." for a bare name).
fs::path parent_of(const std::string& path) {
  const fs::path p = fs::path(path).parent_path();
  return p.empty() ? fs::path(".") : p;
}

void check_writable_dir(const fs::path& dir, const std::string& path, std::string_view what) {
  struct stat st {};
  CUMULUS_CHECK(::stat(dir.c_str(), &st) == 0, "{} '{}': folder '{}' does not exist ({})", what, path, dir.string(),
                errno_text(errno));
  CUMULUS_CHECK(S_ISDIR(st.st_mode), "{} '{}': '{}' is not a folder", what, path, dir.string());
  CUMULUS_CHECK(::access(dir.c_str(), W_OK | X_OK) == 0, "{} '{}': folder '{}' is not writable ({})", what, path,
                dir.string(), errno_text(errno));
}

// Closes the descriptor on every path out of a function.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

void file_check_input(const std::string& path, std::string_view what) {
  CUMULUS_CHECK(!path.empty(), "{}: empty path", what);
  struct stat st {};
  CUMULUS_CHECK(::stat(path.c_str(), &st) == 0, "{} '{}': cannot open ({})", what, path, errno_text(errno));
  CUMULUS_CHECK(!S_ISDIR(st.st_mode), "{} '{}': is a directory, not a file", what, path);
  CUMULUS_CHECK(::access(path.c_str(), R_OK) == 0, "{} '{}': cannot read ({})", what, path, errno_text(errno));
}

std::string file_read(const std::string& path, std::string_view what, size_t max_bytes) {
  file_check_input(path, what);
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  CUMULUS_CHECK(f.fd >= 0, "{} '{}': cannot open ({})", what, path, errno_text(errno));
  struct stat st {};
  CUMULUS_CHECK(::fstat(f.fd, &st) == 0, "{} '{}': cannot stat ({})", what, path, errno_text(errno));
  CUMULUS_CHECK(!S_ISDIR(st.st_mode), "{} '{}': is a directory, not a file", what, path);
  // A regular file's size is known: refuse it before reading. Devices and pipes (/dev/zero,
  // <(cmd)) are read in chunks until the cap.
  CUMULUS_CHECK(!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) <= max_bytes,
                "{} '{}': {} bytes is more than the limit of {} bytes", what, path, st.st_size, max_bytes);
  std::string out;
  if (S_ISREG(st.st_mode)) out.reserve(static_cast<size_t>(st.st_size));
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(f.fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    CUMULUS_CHECK(n >= 0, "{} '{}': read failed after {} bytes ({})", what, path, out.size(), errno_text(errno));
    if (n == 0) break;
    CUMULUS_CHECK(out.size() + static_cast<size_t>(n) <= max_bytes,
                  "{} '{}': more than the limit of {} bytes (stopped reading)", what, path, max_bytes);
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

void file_check_output(const std::string& path, std::string_view what) {
  CUMULUS_CHECK(!path.empty(), "{}: empty path", what);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    CUMULUS_CHECK(!S_ISDIR(st.st_mode), "{} '{}': is a directory; give a file name", what, path);
    CUMULUS_CHECK(S_ISREG(st.st_mode), "{} '{}': exists and is not a regular file", what, path);
  }
  // The result is renamed into place (file_write_atomic): the folder must take new files.
  check_writable_dir(parent_of(path), path, what);
}

void dir_check_output(const std::string& path, std::string_view what) {
  CUMULUS_CHECK(!path.empty(), "{}: empty path", what);
  // The nearest folder that exists must be writable: the rest is created on writing.
  fs::path p = fs::path(path);
  while (true) {
    struct stat st {};
    if (::stat(p.c_str(), &st) == 0) {
      CUMULUS_CHECK(S_ISDIR(st.st_mode), "{} '{}': '{}' exists and is not a folder", what, path, p.string());
      CUMULUS_CHECK(::access(p.c_str(), W_OK | X_OK) == 0, "{} '{}': folder '{}' is not writable ({})", what, path,
                    p.string(), errno_text(errno));
      return;
    }
    const fs::path up = p.parent_path();
    if (up.empty() || up == p) {
      check_writable_dir(fs::path("."), path, what);
      return;
    }
    p = up;
  }
}

void file_write_atomic(const std::string& path, std::string_view bytes, std::string_view what) {
  file_write_atomic_stream(path, what, [&](const FileAppend& append) { append(bytes); });
}

void file_write_atomic_stream(const std::string& path, std::string_view what,
                              const std::function<void(const FileAppend&)>& fill) {
  file_check_output(path, what);
  const fs::path target(path);
  // A hidden name beside the target (same file system, so rename is atomic). Built by
  // append: GCC 12's -Wrestrict misfires on "." + string.
  std::string name(1, '.');
  name.append(target.filename().string()).append(".tmp-XXXXXX");
  std::string tmp = (parent_of(path) / name).string();
  Fd f{::mkstemp(tmp.data())};
  CUMULUS_CHECK(f.fd >= 0, "{} '{}': cannot create a temporary file beside it ({})", what, path, errno_text(errno));
  auto fail = [&](const char* step, int err) {
    ::unlink(tmp.c_str());
    CUMULUS_FAIL("{} '{}': {} failed ({}); the previous file, if any, is unchanged", what, path, step, errno_text(err));
  };
  const FileAppend append = [&](std::string_view bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::write(f.fd, bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail("writing", errno);
      done += static_cast<size_t>(n);
    }
  };
  try {
    fill(append);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  // mkstemp creates 0600; results are ordinary files (0644 less the umask).
  const mode_t mask = ::umask(0);
  ::umask(mask);
  if (::fchmod(f.fd, 0666 & ~mask) != 0) fail("fchmod", errno);
  if (::fsync(f.fd) != 0) fail("fsync", errno);
  const int fd = f.fd;
  f.fd = -1;
  if (::close(fd) != 0) fail("close", errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("rename", errno);
}

}  // namespace cumulus
