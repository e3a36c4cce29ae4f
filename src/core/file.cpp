// Checked reading and atomic writing of user-named files (core/file.h).
#include "cumulus/core/file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <csignal>
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

// What a path that is not a regular file is, for messages.
const char* file_kind_name(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// The temporary files of the writes in flight, for the signal handler: fixed slots of
// fixed size, read with atomics only (nothing else is safe in a handler). A write that finds
// no free slot still works; only its cleanup on a signal is lost.
struct TempSlot {
  std::atomic<int> state{0};  // 0 free, 1 being filled, 2 holds a path
  std::array<char, 4096> path{};
};
std::array<TempSlot, 64> g_temp_slots;

int temp_slot_take(const std::string& path) {
  if (path.size() >= TempSlot{}.path.size()) return -1;
  for (size_t i = 0; i < g_temp_slots.size(); ++i) {
    int expect = 0;
    if (!g_temp_slots[i].state.compare_exchange_strong(expect, 1)) continue;
    std::memcpy(g_temp_slots[i].path.data(), path.c_str(), path.size() + 1);
    g_temp_slots[i].state.store(2);
    return static_cast<int>(i);
  }
  return -1;
}

// Releases its slot on every path out of a write.
struct TempSlotHold {
  int slot = -1;
  ~TempSlotHold() {
    if (slot >= 0) g_temp_slots[static_cast<size_t>(slot)].state.store(0);
  }
};

extern "C" void temp_files_unlink_on_signal(int sig) {
  for (TempSlot& s : g_temp_slots)
    if (s.state.load() == 2) ::unlink(s.path.data());
  // SA_RESETHAND restored the default action; the signal, blocked while this handler runs,
  // is delivered again when it returns and ends the process as it would have.
  ::raise(sig);
}

}  // namespace

void file_check_regular(const std::string& path, std::string_view what) {
  CUMULUS_CHECK(!path.empty(), "{}: empty path", what);
  struct stat st {};
  CUMULUS_CHECK(::stat(path.c_str(), &st) == 0, "{} '{}': cannot open ({})", what, path, errno_text(errno));
  CUMULUS_CHECK(!S_ISDIR(st.st_mode), "{} '{}': is a directory, not a file", what, path);
  CUMULUS_CHECK(S_ISREG(st.st_mode), "{} '{}': is {}, not a regular file", what, path, file_kind_name(st.st_mode));
  CUMULUS_CHECK(::access(path.c_str(), R_OK) == 0, "{} '{}': cannot read ({})", what, path, errno_text(errno));
}

void file_check_distinct(const std::vector<FilePathUse>& paths) {
  struct Id {
    bool exists = false;
    dev_t dev = 0;
    ino_t ino = 0;
    std::string norm;
  };
  std::vector<Id> ids(paths.size());
  for (size_t i = 0; i < paths.size(); ++i) {
    if (paths[i].path.empty()) continue;
    struct stat st {};
    Id& id = ids[i];
    if (::stat(paths[i].path.c_str(), &st) == 0) {
      id.exists = true;
      id.dev = st.st_dev;
      id.ino = st.st_ino;
    }
    std::error_code ec;
    fs::path norm = fs::weakly_canonical(fs::absolute(paths[i].path, ec), ec);
    if (ec) norm = fs::absolute(paths[i].path, ec).lexically_normal();
    id.norm = norm.string();
  }
  for (size_t i = 0; i < paths.size(); ++i) {
    for (size_t j = 0; j < paths.size(); ++j) {
      if (i == j || paths[i].path.empty() || paths[j].path.empty() || !paths[i].output) continue;
      if (paths[j].output && j < i) continue;  // each pair of outputs once
      const bool same = (ids[i].exists && ids[j].exists && ids[i].dev == ids[j].dev && ids[i].ino == ids[j].ino) ||
                        ids[i].norm == ids[j].norm;
      CUMULUS_CHECK(!same, "{} '{}' is the same file as {} '{}': writing it would {}; give another path",
                    paths[i].what, paths[i].path, paths[j].what, paths[j].path,
                    paths[j].output ? "lose one of the two outputs" : "destroy that input");
    }
  }
}

void file_temp_cleanup_on_signals() {
  struct sigaction sa {};
  sa.sa_handler = temp_files_unlink_on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND;
  for (int sig : {SIGINT, SIGTERM}) ::sigaction(sig, &sa, nullptr);
}

void file_check_input(const std::string& path, std::string_view what) {
  CUMULUS_CHECK(!path.empty(), "{}: empty path", what);
  struct stat st {};
  CUMULUS_CHECK(::stat(path.c_str(), &st) == 0, "{} '{}': cannot open ({})", what, path, errno_text(errno));
  CUMULUS_CHECK(!S_ISDIR(st.st_mode), "{} '{}': is a directory, not a file", what, path);
  CUMULUS_CHECK(::access(path.c_str(), R_OK) == 0, "{} '{}': cannot read ({})", what, path, errno_text(errno));
}

std::string file_read(const std::string& path, std::string_view what, size_t max_bytes) {
  file_check_input(path, what);
  // O_NONBLOCK: open() of a FIFO with no writer returns at once (and reads as empty)
  // instead of blocking forever; the reads below block again.
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK)};
  CUMULUS_CHECK(f.fd >= 0, "{} '{}': cannot open ({})", what, path, errno_text(errno));
  if (const int flags = ::fcntl(f.fd, F_GETFL); flags >= 0) ::fcntl(f.fd, F_SETFL, flags & ~O_NONBLOCK);
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
  const fs::path dir = parent_of(path);
  check_writable_dir(dir, path, what);
  // ... and the temporary name beside it, which is longer than the name, must fit.
  const long name_max_sys = ::pathconf(dir.c_str(), _PC_NAME_MAX);
  const size_t name_max = name_max_sys > 0 ? static_cast<size_t>(name_max_sys) : 255;
  const size_t name = fs::path(path).filename().string().size();
  CUMULUS_CHECK(name + kFileTempNameExtra <= name_max,
                "{} '{}': the file name is {} bytes; the folder's file system takes names of at most {} bytes and "
                "the temporary file written first adds {}: give a name of at most {} bytes",
                what, path, name, name_max, kFileTempNameExtra,
                name_max > kFileTempNameExtra ? name_max - kFileTempNameExtra : 0);
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
  const TempSlotHold slot{temp_slot_take(tmp)};  // removed on SIGINT/SIGTERM (file_temp_cleanup_on_signals)
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
