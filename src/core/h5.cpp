/// \file h5.cpp
/// \brief Implementation of the HDF5 RAII wrappers (see h5.hpp).

#include "core/h5.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.hpp"

namespace wlb::h5 {

namespace {

std::string joinDims(const std::vector<hsize_t>& d) {
  std::ostringstream os;
  os << "[";
  for (std::size_t i = 0; i < d.size(); ++i) os << (i ? ", " : "") << d[i];
  os << "]";
  return os.str();
}

std::string childName(const std::string& parent, const std::string& path) {
  if (!path.empty() && path[0] == '/') {
    auto colon = parent.find(":/");
    return (colon == std::string::npos ? parent : parent.substr(0, colon + 1)) + path;
  }
  if (!parent.empty() && parent.back() == '/') return parent + path;
  return parent + "/" + path;
}

void check(herr_t rc, const std::string& what) {
  if (rc < 0) throw Error("HDF5 error: " + what);
}

}  // namespace

void silenceErrors() {
  static const bool done = [] {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    return true;
  }();
  (void)done;
  // H5Eset_auto is per-thread in thread-safe builds; cheap to repeat.
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}

// ---- Handle ------------------------------------------------------------------------------

Handle::Handle(hid_t id, Closer closer, const std::string& what) : id_(id), closer_(closer) {
  if (id < 0) throw Error("HDF5 error: " + what);
}

Handle::~Handle() {
  if (id_ >= 0 && closer_) closer_(id_);
}

Handle::Handle(Handle&& o) noexcept : id_(o.id_), closer_(o.closer_) {
  o.id_ = H5I_INVALID_HID;
  o.closer_ = nullptr;
}

Handle& Handle::operator=(Handle&& o) noexcept {
  if (this != &o) {
    if (id_ >= 0 && closer_) closer_(id_);
    id_ = o.id_;
    closer_ = o.closer_;
    o.id_ = H5I_INVALID_HID;
    o.closer_ = nullptr;
  }
  return *this;
}

void Handle::close() {
  if (id_ >= 0 && closer_) {
    hid_t id = id_;
    id_ = H5I_INVALID_HID;
    check(closer_(id), "close");
  }
}

// ---- PropList ----------------------------------------------------------------------------

PropList PropList::create(hid_t cls) { return PropList(H5Pcreate(cls), H5Pclose, "H5Pcreate"); }

PropList PropList::fileAccess(MPI_Comm comm) {
  auto p = create(H5P_FILE_ACCESS);
  if (comm != MPI_COMM_NULL) check(H5Pset_fapl_mpio(p.id(), comm, MPI_INFO_NULL), "H5Pset_fapl_mpio");
  return p;
}

PropList PropList::collectiveTransfer() {
  auto p = create(H5P_DATASET_XFER);
  check(H5Pset_dxpl_mpio(p.id(), H5FD_MPIO_COLLECTIVE), "H5Pset_dxpl_mpio");
  return p;
}

PropList PropList::independentTransfer() {
  auto p = create(H5P_DATASET_XFER);
  check(H5Pset_dxpl_mpio(p.id(), H5FD_MPIO_INDEPENDENT), "H5Pset_dxpl_mpio");
  return p;
}

PropList PropList::chunked(const std::vector<hsize_t>& chunk) {
  auto p = create(H5P_DATASET_CREATE);
  check(H5Pset_chunk(p.id(), static_cast<int>(chunk.size()), chunk.data()), "H5Pset_chunk");
  return p;
}

// ---- Dataspace ---------------------------------------------------------------------------

Dataspace Dataspace::scalar() { return Dataspace(H5Screate(H5S_SCALAR), H5Sclose, "H5Screate"); }

Dataspace Dataspace::simple(const std::vector<hsize_t>& dims, const std::vector<hsize_t>& maxdims) {
  return Dataspace(H5Screate_simple(static_cast<int>(dims.size()), dims.data(),
                                    maxdims.empty() ? nullptr : maxdims.data()),
                   H5Sclose, "H5Screate_simple " + joinDims(dims));
}

Dataspace Dataspace::adopt(hid_t id) { return Dataspace(id, H5Sclose, "get dataspace"); }

int Dataspace::rank() const { return H5Sget_simple_extent_ndims(id()); }

std::vector<hsize_t> Dataspace::dims() const {
  int r = rank();
  if (r < 0) throw Error("HDF5 error: H5Sget_simple_extent_ndims");
  std::vector<hsize_t> d(static_cast<std::size_t>(r));
  if (r > 0) H5Sget_simple_extent_dims(id(), d.data(), nullptr);
  return d;
}

hsize_t Dataspace::elements() const {
  auto n = H5Sget_simple_extent_npoints(id());
  if (n < 0) throw Error("HDF5 error: H5Sget_simple_extent_npoints");
  return static_cast<hsize_t>(n);
}

void Dataspace::selectHyperslab(const std::vector<hsize_t>& start, const std::vector<hsize_t>& count) {
  check(H5Sselect_hyperslab(id(), H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr),
        "H5Sselect_hyperslab");
}

void Dataspace::selectNone() { check(H5Sselect_none(id()), "H5Sselect_none"); }

// ---- Datatype ----------------------------------------------------------------------------

Datatype Datatype::copyOf(hid_t type) { return Datatype(H5Tcopy(type), H5Tclose, "H5Tcopy"); }

Datatype Datatype::variableString() {
  auto t = copyOf(H5T_C_S1);
  check(H5Tset_size(t.id(), H5T_VARIABLE), "H5Tset_size");
  check(H5Tset_cset(t.id(), H5T_CSET_UTF8), "H5Tset_cset");
  return t;
}

Datatype Datatype::fixedString(std::size_t size) {
  auto t = copyOf(H5T_C_S1);
  check(H5Tset_size(t.id(), std::max<std::size_t>(size, 1)), "H5Tset_size");
  check(H5Tset_strpad(t.id(), H5T_STR_NULLPAD), "H5Tset_strpad");
  check(H5Tset_cset(t.id(), H5T_CSET_UTF8), "H5Tset_cset");
  return t;
}

Datatype Datatype::compound(std::size_t size) {
  return Datatype(H5Tcreate(H5T_COMPOUND, size), H5Tclose, "H5Tcreate compound");
}

Datatype Datatype::adopt(hid_t id) { return Datatype(id, H5Tclose, "get datatype"); }

Datatype& Datatype::insert(const std::string& name, std::size_t offset, hid_t memberType) {
  check(H5Tinsert(id(), name.c_str(), offset, memberType), "H5Tinsert " + name);
  return *this;
}

std::size_t Datatype::size() const { return H5Tget_size(id()); }

H5T_class_t Datatype::typeClass() const { return H5Tget_class(id()); }

std::vector<std::string> Datatype::memberNames() const {
  std::vector<std::string> out;
  if (typeClass() != H5T_COMPOUND) return out;
  int n = H5Tget_nmembers(id());
  for (int i = 0; i < n; ++i) {
    char* s = H5Tget_member_name(id(), static_cast<unsigned>(i));
    if (s) {
      out.emplace_back(s);
      H5free_memory(s);
    }
  }
  return out;
}

// ---- Object (attributes) -----------------------------------------------------------------

bool Object::hasAttribute(const std::string& attr) const {
  return H5Aexists(id(), attr.c_str()) > 0;
}

void Object::setAttributeRaw(const std::string& attr, hid_t type, const void* data,
                             const std::vector<hsize_t>& dims) {
  if (hasAttribute(attr)) check(H5Adelete(id(), attr.c_str()), "H5Adelete " + attr);
  auto space = dims.empty() ? Dataspace::scalar() : Dataspace::simple(dims);
  Handle a(H5Acreate2(id(), attr.c_str(), type, space.id(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose,
           "create attribute " + attr + " on " + name_);
  check(H5Awrite(a.id(), type, data), "write attribute " + attr + " on " + name_);
}

void Object::setAttribute(const std::string& attr, const std::string& value) {
  // Fixed-length strings (exact size) are portable and never need a vlen reclaim.
  auto t = Datatype::fixedString(value.size());
  if (hasAttribute(attr)) check(H5Adelete(id(), attr.c_str()), "H5Adelete " + attr);
  auto space = Dataspace::scalar();
  Handle a(H5Acreate2(id(), attr.c_str(), t.id(), space.id(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose,
           "create attribute " + attr + " on " + name_);
  std::string buf = value.empty() ? std::string(1, '\0') : value;
  check(H5Awrite(a.id(), t.id(), buf.data()), "write attribute " + attr + " on " + name_);
}

namespace {
Handle openAttribute(hid_t obj, const std::string& attr, const std::string& objName) {
  hid_t a = H5Aexists(obj, attr.c_str()) > 0 ? H5Aopen(obj, attr.c_str(), H5P_DEFAULT) : -1;
  if (a < 0) throw InputError(objName + ": missing attribute '" + attr + "'");
  return Handle(a, H5Aclose);
}
}  // namespace

std::string Object::stringAttribute(const std::string& attr) const {
  auto a = openAttribute(id(), attr, name_);
  auto t = Datatype::adopt(H5Aget_type(a.id()));
  if (t.typeClass() != H5T_STRING)
    throw InputError(name_ + ": attribute '" + attr + "' is not a string");
  if (H5Tis_variable_str(t.id()) > 0) {
    auto mt = Datatype::variableString();
    char* s = nullptr;
    check(H5Aread(a.id(), mt.id(), &s), "read attribute " + attr);
    std::string out = s ? s : "";
    if (s) H5free_memory(s);
    return out;
  }
  std::size_t n = t.size();
  std::string buf(n, '\0');
  check(H5Aread(a.id(), t.id(), buf.data()), "read attribute " + attr);
  auto end = buf.find('\0');
  if (end != std::string::npos) buf.resize(end);
  return buf;
}

void Object::readAttributeRaw(const std::string& attr, hid_t memType, void* data, std::size_t n) const {
  auto a = openAttribute(id(), attr, name_);
  auto t = Datatype::adopt(H5Aget_type(a.id()));
  auto c = t.typeClass();
  if (c != H5T_INTEGER && c != H5T_FLOAT)
    throw InputError(name_ + ": attribute '" + attr + "' is not numeric");
  auto s = Dataspace::adopt(H5Aget_space(a.id()));
  if (s.elements() != n)
    throw InputError(name_ + ": attribute '" + attr + "' has " + std::to_string(s.elements()) +
                     " elements, expected " + std::to_string(n));
  check(H5Aread(a.id(), memType, data), "read attribute " + attr);
}

H5T_class_t Object::attributeClass(const std::string& attr) const {
  auto a = openAttribute(id(), attr, name_);
  auto t = Datatype::adopt(H5Aget_type(a.id()));
  return t.typeClass();
}

std::size_t Object::attributeElements(const std::string& attr) const {
  auto a = openAttribute(id(), attr, name_);
  auto s = Dataspace::adopt(H5Aget_space(a.id()));
  return s.elements();
}

std::vector<std::string> Object::attributeNames() const {
  std::vector<std::string> out;
  H5O_info_t info;
#if H5_VERSION_GE(1, 12, 0)
  check(H5Oget_info3(id(), &info, H5O_INFO_NUM_ATTRS), "H5Oget_info");
#else
  check(H5Oget_info2(id(), &info, H5O_INFO_NUM_ATTRS), "H5Oget_info");
#endif
  for (hsize_t i = 0; i < info.num_attrs; ++i) {
    ssize_t len = H5Aget_name_by_idx(id(), ".", H5_INDEX_NAME, H5_ITER_INC, i, nullptr, 0, H5P_DEFAULT);
    if (len < 0) continue;
    std::string s(static_cast<std::size_t>(len) + 1, '\0');
    H5Aget_name_by_idx(id(), ".", H5_INDEX_NAME, H5_ITER_INC, i, s.data(), s.size(), H5P_DEFAULT);
    s.resize(static_cast<std::size_t>(len));
    out.push_back(s);
  }
  return out;
}

// ---- Dataset -----------------------------------------------------------------------------

Dataspace Dataset::space() const { return Dataspace::adopt(H5Dget_space(id())); }
Datatype Dataset::type() const { return Datatype::adopt(H5Dget_type(id())); }
std::vector<hsize_t> Dataset::dims() const { return space().dims(); }

void Dataset::write(hid_t memType, const Dataspace& memSpace, const Dataspace& fileSpace, hid_t dxpl,
                    const void* buf) {
  check(H5Dwrite(id(), memType, memSpace.id(), fileSpace.id(), dxpl, buf), "write " + name_);
}

void Dataset::read(hid_t memType, const Dataspace& memSpace, const Dataspace& fileSpace, hid_t dxpl,
                   void* buf) const {
  if (H5Dread(id(), memType, memSpace.id(), fileSpace.id(), dxpl, buf) < 0)
    throw InputError(name_ + ": read failed (file damaged or type mismatch)");
}

void Dataset::writeAll(hid_t memType, const void* buf, hid_t dxpl) {
  check(H5Dwrite(id(), memType, H5S_ALL, H5S_ALL, dxpl, buf), "write " + name_);
}

void Dataset::readAll(hid_t memType, void* buf, hid_t dxpl) const {
  if (H5Dread(id(), memType, H5S_ALL, H5S_ALL, dxpl, buf) < 0)
    throw InputError(name_ + ": read failed (file damaged or type mismatch)");
}

void Dataset::extend(const std::vector<hsize_t>& dims) {
  check(H5Dset_extent(id(), dims.data()), "extend " + name_);
}

// ---- Location ----------------------------------------------------------------------------

bool Location::exists(const std::string& path) const {
  // Check every prefix: H5Lexists fails on a missing intermediate group.
  std::size_t pos = (!path.empty() && path[0] == '/') ? 1 : 0;
  while (true) {
    auto next = path.find('/', pos);
    std::string prefix = path.substr(0, next);
    if (!prefix.empty() && prefix != "/") {
      if (H5Lexists(id(), prefix.c_str(), H5P_DEFAULT) <= 0) return false;
    }
    if (next == std::string::npos) return true;
    pos = next + 1;
  }
}

Group Location::createGroup(const std::string& path) {
  std::string full = childName(name_, path);
  hid_t g = H5Gcreate2(id(), path.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  if (g < 0) throw Error("HDF5 error: create group " + full);
  return Group(g, full);
}

Group Location::openGroup(const std::string& path) const {
  std::string full = childName(name_, path);
  if (!exists(path)) throw InputError(full + ": no such group");
  hid_t g = H5Gopen2(id(), path.c_str(), H5P_DEFAULT);
  if (g < 0) throw InputError(full + ": cannot open group");
  return Group(g, full);
}

Dataset Location::createDataset(const std::string& path, hid_t type, const Dataspace& space, hid_t dcpl) {
  std::string full = childName(name_, path);
  hid_t d = H5Dcreate2(id(), path.c_str(), type, space.id(), H5P_DEFAULT, dcpl, H5P_DEFAULT);
  if (d < 0) throw Error("HDF5 error: create dataset " + full);
  return Dataset(d, full);
}

Dataset Location::openDataset(const std::string& path) const {
  std::string full = childName(name_, path);
  if (!exists(path)) throw InputError(full + ": no such dataset");
  hid_t d = H5Dopen2(id(), path.c_str(), H5P_DEFAULT);
  if (d < 0) throw InputError(full + ": cannot open dataset (not a dataset or damaged)");
  return Dataset(d, full);
}

std::vector<std::string> Location::children() const {
  std::vector<std::string> out;
  H5G_info_t info;
  check(H5Gget_info(id(), &info), "H5Gget_info " + name_);
  for (hsize_t i = 0; i < info.nlinks; ++i) {
    ssize_t len = H5Lget_name_by_idx(id(), ".", H5_INDEX_NAME, H5_ITER_INC, i, nullptr, 0, H5P_DEFAULT);
    if (len < 0) continue;
    std::string s(static_cast<std::size_t>(len) + 1, '\0');
    H5Lget_name_by_idx(id(), ".", H5_INDEX_NAME, H5_ITER_INC, i, s.data(), s.size(), H5P_DEFAULT);
    s.resize(static_cast<std::size_t>(len));
    out.push_back(s);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<hsize_t> Location::checkNumeric(const Dataset& ds, int expectRank, bool integral) const {
  auto t = ds.type();
  auto c = t.typeClass();
  if (c != H5T_INTEGER && c != H5T_FLOAT)
    throw InputError(ds.name() + ": dataset is not numeric");
  if (integral && c != H5T_INTEGER)
    throw InputError(ds.name() + ": dataset holds floating-point values where integers are expected");
  auto d = ds.dims();
  if (expectRank >= 0 && static_cast<int>(d.size()) != expectRank)
    throw InputError(ds.name() + ": expected a " + std::to_string(expectRank) + "-D dataset, found shape " +
                     joinDims(d));
  return d;
}

void Location::shapeMismatch(const std::string& path, const std::vector<hsize_t>& got,
                             const std::vector<hsize_t>& want) const {
  throw InputError(childName(name_, path) + ": shape " + joinDims(got) + ", expected " + joinDims(want));
}

Dataset Location::writeStrings(const std::string& path, const std::vector<std::string>& values) {
  auto t = Datatype::variableString();
  auto ds = createDataset(path, t.id(), Dataspace::simple({values.size()}));
  std::vector<const char*> ptrs;
  ptrs.reserve(values.size());
  for (const auto& v : values) ptrs.push_back(v.c_str());
  if (!values.empty()) ds.writeAll(t.id(), ptrs.data());
  return ds;
}

std::vector<std::string> Location::readStrings(const std::string& path) const {
  auto ds = openDataset(path);
  auto t = ds.type();
  if (t.typeClass() != H5T_STRING) throw InputError(ds.name() + ": dataset is not a string dataset");
  auto d = ds.dims();
  if (d.size() != 1) throw InputError(ds.name() + ": expected a 1-D string dataset, found shape " + joinDims(d));
  std::vector<std::string> out(d[0]);
  if (d[0] == 0) return out;
  if (H5Tis_variable_str(t.id()) > 0) {
    auto mt = Datatype::variableString();
    std::vector<char*> ptrs(d[0], nullptr);
    ds.readAll(mt.id(), ptrs.data());
    for (std::size_t i = 0; i < ptrs.size(); ++i) out[i] = ptrs[i] ? ptrs[i] : "";
    auto space = ds.space();
    H5Dvlen_reclaim(mt.id(), space.id(), H5P_DEFAULT, ptrs.data());
  } else {
    std::size_t n = t.size();
    std::vector<char> buf(n * d[0]);
    ds.readAll(t.id(), buf.data());
    for (std::size_t i = 0; i < d[0]; ++i) {
      std::string s(buf.data() + i * n, n);
      auto end = s.find('\0');
      if (end != std::string::npos) s.resize(end);
      out[i] = s;
    }
  }
  return out;
}

// ---- File --------------------------------------------------------------------------------

File File::create(const std::string& path, MPI_Comm comm) {
  silenceErrors();
  auto fapl = PropList::fileAccess(comm);
  hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.id());
  if (f < 0) throw Error("HDF5 error: cannot create file " + path);
  return File(f, path);
}

File File::open(const std::string& path, Mode mode, MPI_Comm comm) {
  silenceErrors();
  {
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) throw InputError(path + ": is a directory, not an HDF5 file");
    std::ifstream probe(path, std::ios::binary);
    if (!probe) throw InputError(path + ": cannot open (no such file or not readable)");
  }
  if (H5Fis_hdf5(path.c_str()) <= 0)
    throw InputError(path + ": not an HDF5 file (or truncated)");
  auto fapl = PropList::fileAccess(comm);
  hid_t f = H5Fopen(path.c_str(), mode == Mode::ReadOnly ? H5F_ACC_RDONLY : H5F_ACC_RDWR, fapl.id());
  if (f < 0) throw InputError(path + ": cannot open HDF5 file (truncated or damaged)");
  return File(f, path);
}

bool File::isHdf5(const std::string& path) {
  silenceErrors();
  std::ifstream probe(path, std::ios::binary);
  if (!probe) return false;
  return H5Fis_hdf5(path.c_str()) > 0;
}

void File::flush() { check(H5Fflush(id(), H5F_SCOPE_GLOBAL), "flush " + path_); }

}  // namespace wlb::h5
