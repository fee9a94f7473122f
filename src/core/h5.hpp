#pragma once
/// \file h5.hpp
/// \brief Thin RAII wrappers over the HDF5 C API (parallel 1.10.x), shared by the trace
/// writer/reader, the `wlb kernel` golden files and any other component that reads or
/// writes HDF5.
///
/// Design:
///  - every HDF5 identifier is owned by a move-only handle that closes it (`Handle`);
///  - `File`, `Group` and `Dataset` are `Object`s: they carry attributes and a printable
///    name ("run.h5:/events") used in every error message;
///  - `File` and `Group` are `Location`s: they create/open children and offer one-call
///    helpers for whole numeric datasets (any rank, row-major) and string datasets;
///  - reading errors caused by the file (missing file, missing dataset or attribute,
///    wrong rank/shape/type class) throw `wlb::InputError` naming file and object, so a
///    driver reports them and exits 2; failures while writing throw `h5::Error`
///    (a `std::runtime_error`).
///
/// Parallel use: pass a communicator to `File::create`/`File::open` to get the MPI-IO
/// driver. Then the usual HDF5 rules hold: creating groups/datasets/attributes and
/// writing attributes are collective (every rank calls with identical arguments); dataset
/// raw data is written with `Dataset::write` on a hyperslab selection and a
/// `PropList::collectiveTransfer()` (each rank its own slice). The convenience helpers
/// (`writeDataset`, `writeStrings`, ...) write the whole dataset from the calling process
/// and are meant for serial files (or for data every rank holds identically: in a parallel
/// file only rank 0's data is used for independent writes — prefer the explicit form).
///
/// Example (serial):
/// \code
///   auto f = wlb::h5::File::create("golden.h5");
///   f.writeDataset<float>("q", q.data(), {tokens, heads, head_dim});
///   f.setAttribute("note", std::string("reference"));
///   auto g = wlb::h5::File::open("golden.h5");
///   std::vector<hsize_t> dims;
///   auto q2 = g.readDataset<float>("q", &dims);        // InputError if missing
///   auto doc = g.readDataset<std::int64_t>("doc", 1);  // requires rank 1
/// \endcode

#include <hdf5.h>
#include <mpi.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace wlb::h5 {

/// A failure of the HDF5 library that is not the input's fault (e.g. a write failed).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Turn off HDF5's automatic error-stack printing (errors become exceptions). Called by
/// File::create/open; idempotent and cheap.
void silenceErrors();

/// Native HDF5 type of a C++ arithmetic type (not owned: predefined types never close).
template <class T>
hid_t nativeType();

/// Move-only owner of one HDF5 identifier.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  /// Take ownership of `id` (throws h5::Error with `what` if id < 0).
  Handle(hid_t id, Closer closer, const std::string& what = "HDF5 call");
  ~Handle();
  Handle(Handle&& o) noexcept;
  Handle& operator=(Handle&& o) noexcept;
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  hid_t id() const noexcept { return id_; }
  bool valid() const noexcept { return id_ >= 0; }
  explicit operator bool() const noexcept { return valid(); }
  /// Close now; throws h5::Error if HDF5 reports a failure (destructor never throws).
  void close();

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer closer_ = nullptr;
};

/// Property list (file access, dataset creation, transfer, ...).
class PropList : public Handle {
 public:
  PropList() = default;
  /// New property list of class `cls` (e.g. H5P_DATASET_CREATE).
  static PropList create(hid_t cls);
  /// File access: MPI-IO driver on `comm` if comm != MPI_COMM_NULL, else default (sec2).
  static PropList fileAccess(MPI_Comm comm = MPI_COMM_NULL);
  /// Dataset transfer with collective MPI-IO (falls back to default when not parallel).
  static PropList collectiveTransfer();
  /// Dataset transfer with independent MPI-IO.
  static PropList independentTransfer();
  /// Dataset creation with chunking of the given chunk dims.
  static PropList chunked(const std::vector<hsize_t>& chunk);

 private:
  using Handle::Handle;
};

/// Dataspace: scalar or simple (n-D), with hyperslab selection.
class Dataspace : public Handle {
 public:
  Dataspace() = default;
  static Dataspace scalar();
  /// Simple dataspace; `maxdims` empty -> fixed size; H5S_UNLIMITED allowed.
  static Dataspace simple(const std::vector<hsize_t>& dims, const std::vector<hsize_t>& maxdims = {});
  /// Wrap an identifier returned by H5Dget_space/H5Aget_space.
  static Dataspace adopt(hid_t id);
  int rank() const;
  std::vector<hsize_t> dims() const;
  hsize_t elements() const;
  /// Select the block [start, start+count) (replaces the selection).
  void selectHyperslab(const std::vector<hsize_t>& start, const std::vector<hsize_t>& count);
  /// Select nothing (for ranks that contribute no data to a collective write).
  void selectNone();

 private:
  using Handle::Handle;
};

/// Datatype: copies of predefined types, strings and compound types.
class Datatype : public Handle {
 public:
  Datatype() = default;
  /// A modifiable copy of a predefined or existing type.
  static Datatype copyOf(hid_t type);
  /// Variable-length UTF-8 C string (data are `const char*`).
  static Datatype variableString();
  /// Fixed-size null-padded string of `size` bytes.
  static Datatype fixedString(std::size_t size);
  /// Empty compound of `size` bytes; add members with insert().
  static Datatype compound(std::size_t size);
  /// Wrap an identifier returned by H5Dget_type/H5Aget_type.
  static Datatype adopt(hid_t id);

  /// Add a compound member (returns *this for chaining).
  Datatype& insert(const std::string& name, std::size_t offset, hid_t memberType);
  std::size_t size() const;
  H5T_class_t typeClass() const;
  /// Compound members' names (empty for non-compound types).
  std::vector<std::string> memberNames() const;

 private:
  using Handle::Handle;
};

class Dataset;
class Group;

/// File, group or dataset: something that carries attributes and has a printable name.
class Object : public Handle {
 public:
  Object() = default;
  Object(hid_t id, Closer closer, std::string name, const std::string& what)
      : Handle(id, closer, what), name_(std::move(name)) {}

  /// "file.h5:/path" — used in error messages.
  const std::string& name() const noexcept { return name_; }

  bool hasAttribute(const std::string& attr) const;
  /// Scalar attributes (overwrite if present). Collective in a parallel file.
  void setAttribute(const std::string& attr, const std::string& value);
  void setAttribute(const std::string& attr, const char* value) { setAttribute(attr, std::string(value)); }
  template <class T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
  void setAttribute(const std::string& attr, T value) {
    setAttributeRaw(attr, nativeType<T>(), &value, {});
  }
  /// 1-D numeric attribute.
  template <class T>
  void setAttribute(const std::string& attr, const std::vector<T>& values) {
    setAttributeRaw(attr, nativeType<T>(), values.data(), {static_cast<hsize_t>(values.size())});
  }

  /// Read a string attribute (fixed or variable length). InputError if missing/not string.
  std::string stringAttribute(const std::string& attr) const;
  /// Read a scalar numeric attribute (converted to T). InputError if missing/not numeric.
  template <class T>
  T attribute(const std::string& attr) const {
    T v{};
    readAttributeRaw(attr, nativeType<T>(), &v, 1);
    return v;
  }
  /// Read a 1-D numeric attribute.
  template <class T>
  std::vector<T> vectorAttribute(const std::string& attr) const {
    std::vector<T> v(attributeElements(attr));
    readAttributeRaw(attr, nativeType<T>(), v.data(), v.size());
    return v;
  }
  /// Type class of an attribute (H5T_STRING, H5T_INTEGER, H5T_FLOAT, ...); InputError if
  /// missing.
  H5T_class_t attributeClass(const std::string& attr) const;
  /// Names of all attributes, sorted by name.
  std::vector<std::string> attributeNames() const;

 protected:
  void setAttributeRaw(const std::string& attr, hid_t type, const void* data,
                       const std::vector<hsize_t>& dims);
  void readAttributeRaw(const std::string& attr, hid_t memType, void* data, std::size_t n) const;
  std::size_t attributeElements(const std::string& attr) const;
  std::string name_;
};

/// A dataset (open or newly created).
class Dataset : public Object {
 public:
  Dataset() = default;
  Dataspace space() const;
  Datatype type() const;
  std::vector<hsize_t> dims() const;
  /// Raw write: memory type, memory and file selections, transfer plist (H5P_DEFAULT ok).
  void write(hid_t memType, const Dataspace& memSpace, const Dataspace& fileSpace,
             hid_t dxpl, const void* buf);
  /// Raw read into `buf` (the caller sized it for memSpace).
  void read(hid_t memType, const Dataspace& memSpace, const Dataspace& fileSpace, hid_t dxpl,
            void* buf) const;
  /// Write the whole dataset from `buf` (H5S_ALL).
  void writeAll(hid_t memType, const void* buf, hid_t dxpl = H5P_DEFAULT);
  /// Read the whole dataset into `buf` (H5S_ALL).
  void readAll(hid_t memType, void* buf, hid_t dxpl = H5P_DEFAULT) const;
  /// Extend a chunked dataset (H5Dset_extent).
  void extend(const std::vector<hsize_t>& dims);

 private:
  friend class Location;
  Dataset(hid_t id, std::string name) : Object(id, H5Dclose, std::move(name), "open dataset " + name) {}
};

/// File or group: creates and opens children.
class Location : public Object {
 public:
  Location() = default;
  using Object::Object;

  /// True when a link `path` exists (intermediate groups checked too).
  bool exists(const std::string& path) const;
  Group createGroup(const std::string& path);
  /// InputError naming the file if missing.
  Group openGroup(const std::string& path) const;
  /// Create a dataset (collective in a parallel file). `dcpl` may be H5P_DEFAULT.
  Dataset createDataset(const std::string& path, hid_t type, const Dataspace& space,
                        hid_t dcpl = H5P_DEFAULT);
  /// Open a dataset; InputError naming file and dataset if missing.
  Dataset openDataset(const std::string& path) const;
  /// Names of direct children (groups and datasets), sorted by name.
  std::vector<std::string> children() const;

  /// Create and write a whole numeric dataset of shape `dims` (row-major; product of
  /// dims == number of elements at `data`). Serial convenience.
  template <class T>
  Dataset writeDataset(const std::string& path, const T* data, const std::vector<hsize_t>& dims) {
    auto ds = createDataset(path, nativeType<T>(), Dataspace::simple(dims));
    ds.writeAll(nativeType<T>(), data);
    return ds;
  }
  template <class T>
  Dataset writeDataset(const std::string& path, const std::vector<T>& data) {
    return writeDataset<T>(path, data.data(), {data.size()});
  }
  /// Read a whole numeric dataset (converted to T). If `expectRank` >= 0 the dataset must
  /// have that rank; `dims` (optional) receives the shape. InputError naming the dataset
  /// on a missing dataset, wrong rank or non-numeric type, and on a floating-point dataset
  /// read as integers (HDF5 would truncate 2.5 to 2 without a word).
  template <class T>
  std::vector<T> readDataset(const std::string& path, std::vector<hsize_t>* dims = nullptr,
                             int expectRank = -1) const {
    auto ds = openDataset(path);
    auto d = checkNumeric(ds, expectRank, std::is_integral_v<T>);
    hsize_t n = 1;
    for (auto x : d) n *= x;
    std::vector<T> out(n);
    if (n > 0) ds.readAll(nativeType<T>(), out.data());
    if (dims) *dims = d;
    return out;
  }
  /// Same, requiring exactly `expectedDims` (InputError listing both shapes otherwise).
  template <class T>
  std::vector<T> readDatasetShape(const std::string& path, const std::vector<hsize_t>& expectedDims) const {
    std::vector<hsize_t> d;
    auto v = readDataset<T>(path, &d, static_cast<int>(expectedDims.size()));
    if (d != expectedDims) shapeMismatch(path, d, expectedDims);
    return v;
  }
  /// Write a 1-D variable-length string dataset.
  Dataset writeStrings(const std::string& path, const std::vector<std::string>& values);
  /// Read a 1-D string dataset (fixed or variable length).
  std::vector<std::string> readStrings(const std::string& path) const;

 private:
  std::vector<hsize_t> checkNumeric(const Dataset& ds, int expectRank, bool integral) const;
  [[noreturn]] void shapeMismatch(const std::string& path, const std::vector<hsize_t>& got,
                                  const std::vector<hsize_t>& want) const;
};

class Group : public Location {
 public:
  Group() = default;

 private:
  friend class Location;
  Group(hid_t id, std::string name) : Location(id, H5Gclose, std::move(name), "open group " + name) {}
};

/// An HDF5 file. Parallel when a communicator is given (collective open/create/close).
class File : public Location {
 public:
  enum class Mode { ReadOnly, ReadWrite };
  File() = default;
  /// Create (truncate) `path`. h5::Error if it cannot be created.
  static File create(const std::string& path, MPI_Comm comm = MPI_COMM_NULL);
  /// Open an existing file. InputError naming the file if it is missing, truncated or not
  /// HDF5.
  static File open(const std::string& path, Mode mode = Mode::ReadOnly, MPI_Comm comm = MPI_COMM_NULL);
  /// True when `path` exists and is an HDF5 file (never throws).
  static bool isHdf5(const std::string& path);
  const std::string& path() const noexcept { return path_; }
  void flush();

 private:
  File(hid_t id, std::string path) : Location(id, H5Fclose, path + ":/", "open file " + path), path_(std::move(path)) {}
  std::string path_;
};

// ---- nativeType specialisations --------------------------------------------------------
template <> inline hid_t nativeType<char>() { return H5T_NATIVE_CHAR; }
template <> inline hid_t nativeType<signed char>() { return H5T_NATIVE_SCHAR; }
template <> inline hid_t nativeType<unsigned char>() { return H5T_NATIVE_UCHAR; }
template <> inline hid_t nativeType<short>() { return H5T_NATIVE_SHORT; }
template <> inline hid_t nativeType<unsigned short>() { return H5T_NATIVE_USHORT; }
template <> inline hid_t nativeType<int>() { return H5T_NATIVE_INT; }
template <> inline hid_t nativeType<unsigned int>() { return H5T_NATIVE_UINT; }
template <> inline hid_t nativeType<long>() { return H5T_NATIVE_LONG; }
template <> inline hid_t nativeType<unsigned long>() { return H5T_NATIVE_ULONG; }
template <> inline hid_t nativeType<long long>() { return H5T_NATIVE_LLONG; }
template <> inline hid_t nativeType<unsigned long long>() { return H5T_NATIVE_ULLONG; }
template <> inline hid_t nativeType<float>() { return H5T_NATIVE_FLOAT; }
template <> inline hid_t nativeType<double>() { return H5T_NATIVE_DOUBLE; }

}  // namespace wlb::h5
